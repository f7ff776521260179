"""Progress of a checkpoint load for the hang watchdog: a load of a large checkpoint from a slow file
system may take longer than the start-up allowance, and is not a hang while it reads."""

from __future__ import annotations

import contextlib

from k2.launcher.progress import moved

__all__ = ["load_progress"]


@contextlib.contextmanager
def load_progress():
    """Every tensor and object DCP reads counts as progress for the hang watchdog
    (:func:`k2.launcher.progress.moved`): torch's ``FileSystemReader.read_data`` gets a planner that
    reports each ``resolve_tensor`` / ``load_bytes`` and passes everything on (torch offers no progress
    callback for a load; megatron's planner overrides both, so the planner classes are not patched)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class Reporting:
        def __init__(self, planner):
            self._planner = planner

        def __getattr__(self, name):
            return getattr(self._planner, name)

        def resolve_tensor(self, *args, **kwargs):
            moved()
            return self._planner.resolve_tensor(*args, **kwargs)

        def load_bytes(self, *args, **kwargs):
            moved()
            return self._planner.load_bytes(*args, **kwargs)

    original = FileSystemReader.read_data
    FileSystemReader.read_data = lambda self, plan, planner: original(self, plan, Reporting(planner))
    try:
        yield
    finally:
        FileSystemReader.read_data = original
