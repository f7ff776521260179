"""The one exception type for a bad setting, and the standard form of its message that every section's check
uses (:func:`require`) (the bottom of the project: imports nothing of it)."""

from __future__ import annotations

import math
from typing import Any


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


def require(ok: bool, setting: str, value: Any, allowed: str) -> None:
    """Raise ``ConfigError("<setting>=<value!r>; allowed: <allowed>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{setting}={value!r}; allowed: {allowed}")


def finite(value: Any) -> bool:
    """Whether ``value`` is a finite int or float (a bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
