"""The one exception type for a bad setting (the bottom of the project: imports nothing of it)."""

from __future__ import annotations


def one_line(text: str) -> str:
    """``text`` with every character that is not printable (a newline, a carriage return, a tab, other
    control and format characters) written as its Python escape (``\\n``, ``\\r``, ``\\x0b``, ...)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


class ConfigError(ValueError):
    """A setting is invalid. The message names the setting and the allowed values.

    Every tool turns it into one line ``<tool>: error: <message>`` on stderr and exit status 2
    (:mod:`k2.launcher.cli`), before any process group, download or heavy computation starts. The message
    is kept on one line (:func:`one_line`) whatever value it quotes: a setting's value can hold a newline,
    which would otherwise end the line and start one that looks like another tool's output.
    """

    def __init__(self, message: object = "", *args):
        super().__init__(one_line(message) if isinstance(message, str) else message, *args)
