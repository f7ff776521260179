"""megatron-core's indexed-dataset index format (``PREFIX.idx``, version 1), restated.

The constants of ``megatron.core.datasets.indexed_dataset`` (``_INDEX_HEADER``, ``DType`` and its
``optimal_dtype`` rule) that the
``.idx`` reader (:mod:`k2.launcher.datasets.resolve`) and writer
(:mod:`k2.launcher.datasets.indexed_writer`) need. Restated, not imported, because importing that module
imports megatron-core and torch: ~2.4 s and ~900 MB of resident memory, which ``k2-data`` otherwise never
needs. ``tests/unit/launcher/datasets/test_indexed_writer.py`` checks them against megatron-core's own and the
written bytes against its ``IndexedDatasetBuilder``.

Layout: the header ``MMIDIDX\\0\\0``, version ``<Q`` 1, the dtype code ``<B``, the sequence count ``<Q``,
the document count + 1 ``<Q`` (:data:`HEADER_BYTES` = 34 bytes in all), then the sequence lengths (int32),
the sequence byte offsets into ``.bin`` (int64) and the document indices (int64).
"""

from __future__ import annotations

import numpy as np

__all__ = ["CODE_OF_DTYPE", "DTYPE_OF_CODE", "HEADER_BYTES", "INDEX_HEADER", "VERSION", "token_dtype"]

INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron's _INDEX_HEADER
VERSION = 1
HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8
#: megatron's ``DType`` codes of the token dtypes
DTYPE_OF_CODE = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): c for c, t in DTYPE_OF_CODE.items()}


def token_dtype(vocab_size: int):
    """The ``.bin`` token dtype for ``vocab_size`` ids: megatron-core's ``DType.optimal_dtype`` rule
    (uint16 below 65,500 ids, else int32)."""
    return np.uint16 if vocab_size < 65500 else np.int32
