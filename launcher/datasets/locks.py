"""An exclusive advisory file lock shared by the corpus build and the dataset-index build."""

from __future__ import annotations

import contextlib
import fcntl
import os


@contextlib.contextmanager
def file_lock(path: str, remove: bool = False):
    """Exclusive advisory lock (``flock``) on the file ``path``; released by the kernel if the process dies.

    With ``remove=True`` the lock file is deleted when the lock is released (nothing is left beside a
    finished build). Deleting a lock file is safe only because every taker checks, once it holds the
    lock, that ``path`` still names the file it locked, and starts over otherwise (a waiter that locked
    a deleted file would otherwise run beside a newcomer that locked a new one).
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        f = open(path, "a")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(f.fileno()).st_ino:
            break
        f.close()  # the holder before us deleted it: lock the file now at that path
    try:
        yield
    finally:
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        f.close()
