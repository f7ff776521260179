"""Progress inside long work, for the process's hang watchdog: an evaluation batch done, a checkpoint
file hashed, a chunk of a dataset tokenized, a checkpoint tensor loaded, bytes of a save written.

A long evaluation, first save, dataset build or checkpoint load is not a hang as long as it moves. The
work reports that from inside, where it happens, by calling :func:`moved` (cheap: a call per batch or
per file is fine), or registers a :func:`measured` probe while it waits on work it cannot instrument (a
library writing files in its own threads: the bytes written grow). Whoever watches the process
(:class:`k2.launcher.training.watchdog.HangWatchdog`) installs a sink with :func:`watch` and polls the
probes with :func:`probes_grew`. Without a watcher both are no-ops.

Imports nothing of k2-launcher and nothing heavy (a layer of its own below the building blocks that
report into it: datasets, checkpointing).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

__all__ = ["measured", "moved", "probes_grew", "watch"]

_SINKS: list = []  # called by moved(); the watchdog's
_PROBES: dict = {}  # id -> [probe, last value]
_LOCK = threading.Lock()


def moved() -> None:
    """The work of the current point made progress (safe from any thread)."""
    for sink in list(_SINKS):
        sink()


@contextlib.contextmanager
def watch(sink: Callable[[], None]):
    """Install ``sink`` for :func:`moved` for the duration of the block."""
    _SINKS.append(sink)
    try:
        yield
    finally:
        _SINKS.remove(sink)


@contextlib.contextmanager
def measured(probe: Callable[[], int]):
    """While the block runs, ``probe()`` (a number that grows while the work moves, e.g. the bytes of the
    files being written) is polled by the watcher: each growth counts as progress."""
    key = object()
    with _LOCK:
        _PROBES[key] = [probe, None]
    try:
        yield
    finally:
        with _LOCK:
            del _PROBES[key]


def probes_grew() -> bool:
    """Whether any probe's value grew since the previous call (a probe's first value counts as growth:
    the work just started). For the watcher's thread; a probe that raises is skipped."""
    grew = False
    with _LOCK:
        entries = list(_PROBES.values())
    for entry in entries:
        try:
            value = entry[0]()
        except Exception:
            continue
        if entry[1] is None or value > entry[1]:
            grew = True
        entry[1] = value
    return grew
