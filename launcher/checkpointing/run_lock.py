"""One owner per run directory: an exclusive ``flock`` on ``<run.dir>/.owner.lock``, held for the run.

The owner is the process that starts a run: ``k2-train`` when it spawns its local ranks itself (the ranks
it spawns take no lock: they enter training directly with its plan), otherwise global rank 0 (one process per rank
under torchrun or srun, or a single-process run). The lock is taken before anything in the run
directory is written (the start-up removal of ``.partial`` saves, metrics, checkpoints), the resume
decision is made again under it, and it is
released by the kernel when the owner's file descriptor closes, i.e. when the owner exits or dies by any
signal, ``kill -9`` included, so no stale lock is ever left to clean up.

The file holds ``<host> <pid>`` of the owner, so that a refused trainer can name it. ``flock`` is advisory
and per host on some network file systems: on a cluster the run directory must be on a file system whose
``flock`` is coherent across nodes (NFSv4, Lustre mounted with ``flock``), as it is for the checkpoints.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from k2.config.errors import ConfigError

__all__ = ["OWNER_LOCK", "RunDirBusy", "RunDirLock", "owner_of", "raise_if_busy"]

#: the lock file's name inside the run directory
OWNER_LOCK = ".owner.lock"


class RunDirBusy(ConfigError):
    """Another live process owns the run directory; the message names its host and pid."""


class RunDirLock:
    """The exclusive ownership of one run directory (created if missing).

    Use :meth:`acquire` (or ``with RunDirLock.acquire(run_dir):``); the lock lasts until :meth:`release`
    or the end of the process.
    """

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self._fd = run_dir, fd

    @classmethod
    def acquire(cls, run_dir, wait_owner_s: float = 2.0) -> RunDirLock:
        """Take the lock of ``run_dir`` without waiting for it.

        Args:
            run_dir: the run directory (created, with its parents, if missing).
            wait_owner_s: when the lock is held, how long (seconds) to wait for its owner to have written
                its host and pid (an owner that started at the same moment may not have yet).

        Raises:
            RunDirBusy: another process holds it (the message names host, pid, run dir and lock file).
            ConfigError: the run directory or its lock file cannot be created or locked (e.g. no
                permission, a read-only file system).
        """
        run_dir = Path(run_dir)
        path = run_dir / OWNER_LOCK
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # never truncated here
        except OSError as e:
            raise ConfigError(f"run.dir={run_dir}: cannot create its lock file {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if not _held(e):
                os.close(fd)
                raise ConfigError(f"run.dir={run_dir}: cannot lock {path}: {e.strerror}") from None
            owner = _read_owner(fd, wait_owner_s)
            os.close(fd)
            raise RunDirBusy(
                f"run.dir={run_dir} is in use by another trainer ({owner}; lock {path}); "
                "wait for it to end or choose another run.dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        return cls(run_dir, fd)

    def release(self) -> None:
        """Give up the lock (idempotent); the file stays, empty of meaning until the next owner writes it."""
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def raise_if_busy(run_dir) -> None:
    """Raise :class:`RunDirBusy` when another process owns ``run_dir``; nothing when it has no lock file
    or nobody holds it. For a refusal decided before the lock was taken: a run dir that another trainer
    is writing at that moment (e.g. its first metrics, no checkpoint yet) must be reported as busy, not
    judged by its half-written state."""
    if (Path(run_dir) / OWNER_LOCK).exists():
        RunDirLock.acquire(run_dir).release()


def owner_of(run_dir) -> tuple[str, str] | None:
    """``(host, pid)`` of the live process that owns ``run_dir`` (``("", "")`` while it has not written
    them yet), or None when nobody holds the lock or there is no lock file. A shared, non-blocking probe:
    nothing is created, written or kept locked."""
    try:
        fd = os.open(Path(run_dir) / OWNER_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except OSError as e:
        if not _held(e):
            return None
        return _owner_parts(fd, 0.0) or ("", "")
    finally:
        os.close(fd)


def _held(e: OSError) -> bool:
    """True when a non-blocking ``flock`` failed because another process holds the lock."""
    return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _owner_parts(fd: int, wait_s: float) -> tuple[str, str] | None:
    """``(host, pid)`` from the lock file, waiting up to ``wait_s`` for a just-started owner to write them
    (None: not written)."""
    deadline = time.monotonic() + wait_s
    while True:
        parts = os.pread(fd, 256, 0).decode(errors="replace").split()
        if parts or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _read_owner(fd: int, wait_s: float) -> str:
    """``host H, pid P`` from the lock file, waiting up to ``wait_s`` for a just-started owner to write."""
    parts = _owner_parts(fd, wait_s)
    return f"host {parts[0]}, pid {parts[1]}" if parts else "owner not recorded yet"
