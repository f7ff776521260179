"""What identifies a dataset's contents cheaply: the fingerprint of a megatron indexed dataset prefix, which
resume compares instead of ``data.path`` strings (a relative path to the same files is the same dataset;
other files behind the same path are not).
"""

from __future__ import annotations

import hashlib
import os

#: bytes hashed at the start and at the end of each file
_EDGE = 1 << 20


def _edges_sha256(path: str, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        if size > 2 * _EDGE:
            f.seek(size - _EDGE)
        h.update(f.read(_EDGE))
    return h.hexdigest()


def dataset_fingerprint(prefix: str) -> dict:
    """``{"bin_bytes", "idx_bytes", "sha256"}`` of ``PREFIX.bin`` / ``PREFIX.idx``: both sizes and a SHA-256
    of the first and last MiB of each (the ``.idx`` starts with the document count and ends with the
    document offsets, so another tokenization or another document set changes it) -- a few MiB read
    whatever the dataset's size, not a hash of its contents.

    Raises:
        OSError: a file is missing or unreadable.
    """
    out, h = {}, hashlib.sha256()
    for ext in ("bin", "idx"):
        path = f"{prefix}.{ext}"
        size = os.path.getsize(path)
        out[f"{ext}_bytes"] = size
        h.update(_edges_sha256(path, size).encode())
    out["sha256"] = h.hexdigest()
    return out
