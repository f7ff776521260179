"""The file checksum of every manifest k2-launcher writes: checkpoints (``k2_manifest.json``) and the
datasets of ``k2-data`` (``PREFIX.manifest.json``).

xxh3-64 (``xxhash``): 5-5.7 GB/s on one core of a loaded 2-core machine, several times zlib.crc32's
speed, so hashing runs about as fast as the files are read. Not a cryptographic hash: it finds damage
(a truncated, zeroed or overwritten file), not tampering.

Imports nothing of k2-launcher (a layer of its own below the building blocks that hash files:
datasets, checkpointing).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

__all__ = ["ALGORITHM", "CHUNK_BYTES", "file_checksum", "file_entries", "hasher"]

#: the name under which a manifest records the checksum (``{"size": ..., "xxh3_64": ...}``)
ALGORITHM = "xxh3_64"
#: bytes read per hash update
CHUNK_BYTES = 8 << 20


def hasher():
    """A new streaming xxh3-64 hash (``update(bytes)``, ``hexdigest()``): for bytes hashed as they are
    written, so that a writer's checksum costs no second read."""
    import xxhash

    return xxhash.xxh3_64()


def file_checksum(path, on_bytes: Callable[[int], None] | None = None, start: int = 0, end: int | None = None) -> str:
    """The xxh3-64 checksum of the file at ``path`` (of its bytes ``start`` to ``end``, default the whole
    file) as 16 hex digits, read in :data:`CHUNK_BYTES` chunks; ``on_bytes(n)`` is called after each chunk
    of ``n`` bytes (a progress bar, a hang watchdog).

    Raises:
        OSError: the file cannot be read.
    """
    h = hasher()
    with open(path, "rb") as f:
        f.seek(start)
        left = None if end is None else end - start
        while chunk := f.read(CHUNK_BYTES if left is None else min(CHUNK_BYTES, left)):
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return h.hexdigest()


def file_entries(directory, names: Iterable[str], on_bytes: Callable[[int], None] | None = None) -> dict:
    """``{name: {"size": bytes, "xxh3_64": hex}}`` for the files ``names`` of ``directory``: a manifest's
    entries."""
    return {
        n: {
            "size": os.path.getsize(os.path.join(directory, n)),
            ALGORITHM: file_checksum(os.path.join(directory, n), on_bytes),
        }
        for n in names
    }
