"""A megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``) written in constant memory.

Why not megatron-core's ``IndexedDatasetBuilder``: it keeps one Python int per document in two lists
(``sequence_lengths``, ``document_indices``) and at ``finalize`` builds a third (the byte offsets, via
``_IndexWriter._sequence_pointers``) before converting each to a numpy array: about 100 bytes per
document, so the memory of a build grows with the corpus (a 1.1 GB JSONL corpus of 4.4 M documents was
killed by a 600 MB memory limit in ``finalize``; a 100 M-document dataset would need ~10 GB). This writer
writes the same bytes -- megatron-core's index format, version 1, one sequence per document, read back
by megatron's ``IndexedDataset`` -- with the per-document lengths spooled to a temporary file next to the
output and the offsets and document indices generated block by block at the end, so its memory is one
block (``BLOCK`` documents) whatever the corpus size. Format, from megatron-core's ``_IndexWriter``:
:mod:`k2.launcher.datasets.idx_format` (one sequence per document: the document indices are
``0 .. documents``). Both files are hashed as they are written (:data:`IndexedDatasetWriter.outputs`: the
size and xxh3-64 checksum of each, for the manifest; no second read).
"""

from __future__ import annotations

import os
import struct

import numpy as np

from k2.launcher.checksums import ALGORITHM, hasher
from k2.launcher.datasets.idx_format import CODE_OF_DTYPE, INDEX_HEADER, VERSION

__all__ = ["IndexedDatasetWriter"]

#: documents per block when the index is written (int64 offsets: 8 MB per array block)
BLOCK = 1 << 20


class IndexedDatasetWriter:
    """Write one megatron indexed dataset, documents appended in bulk.

    Args:
        prefix: the output path without suffix; writes ``prefix.bin``, ``prefix.idx`` (and, until
            :meth:`finalize`, ``prefix.lengths.tmp``).
        dtype: the token dtype (numpy; megatron's ``DType`` codes: uint8, int8, int16, int32, int64,
            float64, float32, uint16).

    Raises:
        ValueError: a dtype that megatron cannot store; from :meth:`add_documents`, a length array that
            does not sum to the token count.
    """

    def __init__(self, prefix: str, dtype) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(
                f"token dtype {self.dtype} has no megatron DType code; allowed: "
                + ", ".join(str(d) for d in CODE_OF_DTYPE)
            )
        self._code = CODE_OF_DTYPE[self.dtype]
        self._bin = open(prefix + ".bin", "wb")
        self._bin_hash = hasher()
        #: after :meth:`finalize`: ``{"NAME.bin": {"size": bytes, "xxh3_64": hex}, "NAME.idx": {...}}``
        self.outputs: dict = {}
        self._lengths_path = prefix + ".lengths.tmp"
        self._lengths = open(self._lengths_path, "wb")
        self.documents = 0
        self.tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` [sum(lengths)] (their ids back to back, cast to the dataset's
        dtype), ``lengths`` [documents] (tokens per document, each < 2**31)."""
        lengths = np.asarray(lengths)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} tokens, {tokens.size} given")
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._bin.write(data)
        self._bin_hash.update(data)
        self._lengths.write(lengths.astype(np.int32).tobytes())
        self.documents += int(lengths.size)
        self.tokens += int(tokens.size)

    def finalize(self) -> None:
        """Close ``prefix.bin`` and write ``prefix.idx`` (module docstring), in blocks; fills :attr:`outputs`."""
        self._bin.close()
        self._lengths.close()
        n, itemsize = self.documents, self.dtype.itemsize
        idx_hash, idx_bytes = hasher(), 0
        with open(self.prefix + ".idx", "wb") as idx, open(self._lengths_path, "rb") as spool:

            def write(data: bytes) -> None:
                nonlocal idx_bytes
                idx.write(data)
                idx_hash.update(data)
                idx_bytes += len(data)

            write(INDEX_HEADER + struct.pack("<Q", VERSION) + struct.pack("<B", self._code))
            write(struct.pack("<Q", n) + struct.pack("<Q", n + 1))
            for block in _blocks(spool):  # sequence lengths
                write(block.tobytes())
            spool.seek(0)
            offset = 0
            for block in _blocks(spool):  # byte offset of each sequence in .bin
                ends = np.cumsum(block, dtype=np.int64) * itemsize + offset
                write((ends - block.astype(np.int64) * itemsize).tobytes())
                offset = int(ends[-1])
            for lo in range(0, n + 1, BLOCK):  # document indices: one sequence per document
                write(np.arange(lo, min(n + 1, lo + BLOCK), dtype=np.int64).tobytes())
        os.remove(self._lengths_path)
        name = os.path.basename(self.prefix)
        self.outputs = {
            name + ".bin": {"size": self.tokens * itemsize, ALGORITHM: self._bin_hash.hexdigest()},
            name + ".idx": {"size": idx_bytes, ALGORITHM: idx_hash.hexdigest()},
        }


def _blocks(f):
    """The int32 lengths of the spool file ``f``, ``BLOCK`` at a time."""
    while True:
        block = np.frombuffer(f.read(4 * BLOCK), dtype=np.int32)
        if block.size == 0:
            return
        yield block
