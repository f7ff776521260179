"""The constant-memory indexed dataset writer of k2-data (launcher/datasets/indexed_writer.py) against
megatron-core's own ``IndexedDatasetBuilder`` (the reference: same bytes) and reader."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from k2.launcher.datasets import indexed_writer
from k2.launcher.datasets.indexed_writer import IndexedDatasetWriter


def _documents(n: int, seed: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_same_bytes_as_megatrons_builder_and_read_back_by_megatron(tmp_path, monkeypatch, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    monkeypatch.setattr(indexed_writer, "BLOCK", 7)  # several blocks per array, a partial last one
    docs = _documents(50, seed=3, vocab=60_000)
    ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for d in docs:
        ref.add_document(d, [d.size])
    ref.finalize(str(tmp_path / "ref.idx"))

    w = IndexedDatasetWriter(str(tmp_path / "ours"), dtype)
    for lo, hi in ((0, 1), (1, 20), (20, 20), (20, 50)):  # bulk appends of 1, 19, 0 and 30 documents
        part = docs[lo:hi]
        w.add_documents(np.concatenate(part) if part else np.zeros(0, dtype), np.array([d.size for d in part]))
    w.finalize()

    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes(), suffix
    assert not (tmp_path / "ours.lengths.tmp").exists()
    ds = IndexedDataset(str(tmp_path / "ours"))
    assert len(ds) == 50 and all(np.array_equal(ds[i], d) for i, d in enumerate(docs))
    assert (w.documents, w.tokens) == (50, sum(d.size for d in docs))


def test_memory_does_not_grow_with_the_documents(tmp_path, monkeypatch):
    """300,000 documents through the writer in chunks of 2,048 (k2-data's chunk) with 8,192-document index
    blocks: the traced peak stays under 1 MB, where megatron's builder holds three Python ints per document
    (>= 300,000 x 3 x 28 B = 25 MB) at its finalize."""
    monkeypatch.setattr(indexed_writer, "BLOCK", 8192)
    w = IndexedDatasetWriter(str(tmp_path / "big"), np.uint16)
    lengths = np.full(2048, 3, dtype=np.int64)
    tokens = np.arange(3 * 2048, dtype=np.uint16)
    tracemalloc.start()
    try:
        for _ in range(300_000 // 2048):
            w.add_documents(tokens, lengths)
        w.finalize()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert w.documents == 2048 * (300_000 // 2048)
    assert peak < 1_000_000, peak
    idx = (tmp_path / "big.idx").stat().st_size
    assert idx == 9 + 8 + 1 + 8 + 8 + w.documents * (4 + 8) + (w.documents + 1) * 8


def test_lengths_that_do_not_sum_to_the_tokens_are_refused(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "x"), np.uint16)
    with pytest.raises(ValueError, match="lengths sum to 5 tokens, 4 given"):
        w.add_documents(np.zeros(4, np.uint16), np.array([2, 3]))


def test_format_constants_are_megatrons():
    """The restated header, version and dtype codes (k2.launcher.datasets.idx_format) are megatron-core's
    (``_INDEX_HEADER``, ``DType``: every member, both ways)."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    from k2.launcher.datasets import idx_format

    assert idx_format.INDEX_HEADER == _INDEX_HEADER and idx_format.VERSION == 1
    assert {m.value: m.name for m in DType} == {c: np.dtype(t).name for c, t in idx_format.DTYPE_OF_CODE.items()}
    for t in idx_format.DTYPE_OF_CODE.values():
        assert DType.code_from_dtype(t) == idx_format.CODE_OF_DTYPE[np.dtype(t)]


def test_an_unstorable_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="float16 has no megatron DType code; allowed: uint8"):
        IndexedDatasetWriter(str(tmp_path / "x"), np.float16)
