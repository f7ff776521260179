"""The one exception type for a bad setting (the bottom of the project: imports nothing of it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting is invalid. The message names the setting and the allowed values.

    Every tool turns it into one line ``<tool>: error: <message>`` on stderr and exit status 2
    (:mod:`k2.launcher.cli`), before any process group, download or heavy computation starts.
    """
