"""The pieces of an array build (``prepare.tasks``): the input cut into byte ranges at record boundaries.

The input files, in the order ``prepare.input`` names them, are read as one stream of records. A piece
starts where the previous one ended and ends at the first record boundary at or after
``prepare.shard_bytes`` bytes of input: inside an uncompressed JSONL file, the start of a line; elsewhere
(a compressed file, Parquet, plain text) only the end of the file, since a record boundary of those is
not found without decompressing or parsing from the start. A piece may span several small files (each a
segment of it) and a large JSONL file is cut into several pieces. The cuts depend on the files' bytes and
``prepare.shard_bytes`` alone -- not on the number of tasks -- so every piece, and the shard tokenized
from it, is the same whichever task builds it. Finding a cut reads from the target offset to the next
newline (one block, typically), so planning a corpus of any size costs a few reads per piece.

A segment is ``(file index, start byte, end byte)``; a piece is a list of segments.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from k2.launcher.datasets.sources import InputFile

__all__ = ["cut_pieces", "input_state", "line_start", "piece_inputs"]

_SCAN = 1 << 16  # bytes read per step while looking for the next newline


def line_start(path: str, offset: int, size: int) -> int:
    """The first offset ``p >= offset`` of the file at ``path`` (``size`` bytes) where a line starts
    (``p == 0`` or byte ``p - 1`` is a newline), or ``size`` when no line starts after ``offset``."""
    if offset <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        pos = offset - 1
        while block := f.read(_SCAN):
            i = block.find(b"\n")
            if i >= 0:
                return min(pos + i + 1, size)
            pos += len(block)
    return size


def cut_pieces(files: Sequence[InputFile], shard_bytes: int) -> list[list[tuple[int, int, int]]]:
    """The pieces of ``files`` (module docstring): each a list of ``(file index, start, end)`` segments
    holding at least ``shard_bytes`` bytes of input, the last piece the rest. Empty files are in no piece."""
    pieces, current, held = [], [], 0
    for fi, f in enumerate(files):
        pos = 0
        while pos < f.bytes:
            target = pos + shard_bytes - held
            cut = line_start(f.path, target, f.bytes) if f.cuttable and target < f.bytes else f.bytes
            current.append((fi, pos, cut))
            held += cut - pos
            pos = cut
            if held >= shard_bytes:
                pieces.append(current)
                current, held = [], 0
    if current:
        pieces.append(current)
    return pieces


def piece_inputs(files: Sequence[InputFile], segments: Sequence[Sequence[int]]) -> list[InputFile]:
    """The segments of a piece as the inputs :func:`k2.launcher.datasets.sources.read_records` reads: a
    whole file as it is, a range of a file with its ``start`` / ``end`` (and ``bytes`` the range's)."""
    out = []
    for fi, start, end in segments:
        f = files[fi]
        if start == 0 and end == f.bytes:
            out.append(f)
        else:
            out.append(dataclasses.replace(f, bytes=end - start, start=start, end=end))
    return out


def input_state(f: InputFile) -> dict:
    """``{"path", "bytes", "mtime_ns"}`` of an input: what a plan records and a task checks (hashing every
    input before the array starts would read the whole corpus in one process; each task hashes its own
    segments instead)."""
    return {"path": f.path, "bytes": f.bytes, "mtime_ns": os.stat(f.path).st_mtime_ns}
