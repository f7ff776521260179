"""The resumable tokenization of ``k2-data prepare``: records -> committed chunks -> megatron datasets.

The records of a list of inputs (:mod:`k2.launcher.datasets.sources`: whole files, or byte ranges of
them) are read in order by one process and tokenized in chunks of ``prepare.chunk_documents`` records
(fewer where they reach ``prepare.chunk_bytes`` bytes of input: the memory of a chunk is bounded whatever
the document size) by ``prepare.workers`` processes (:class:`k2.launcher.datasets.tokenize_pool.TokenizerPool`);
chunks are committed in input order into a work directory (each written under a temporary name, then
renamed: a chunk is complete or absent), so the output bytes do not depend on the number of workers and
a build killed at any point continues after its last committed chunk. :func:`write_datasets` then writes
the committed chunks as megatron indexed datasets in the memory of one chunk, hashing every file as it
is written (:class:`k2.launcher.datasets.indexed_writer.IndexedDatasetWriter`).

Used by the one-process build (:mod:`k2.launcher.datasets.preprocess`: one work directory for the whole
input) and by each piece of an array build (:mod:`k2.launcher.datasets.array_build`: one per piece).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from k2.config.errors import ConfigError
from k2.launcher.datasets.sources import InputFile, read_records
from k2.launcher.datasets.tokenize_pool import TokenizerPool

if TYPE_CHECKING:
    from k2.config.schema import PrepareConfig

__all__ = ["MAX_REPORTED_BAD", "bad_record_error", "commit_chunk", "tokenize_chunks", "write_datasets"]

MAX_REPORTED_BAD = 100  # bad records listed in a manifest (all are counted)
_MAX_PRINTED_BAD = 20
#: test seam: seconds to sleep after each committed chunk (a build slow enough to be killed in the middle)
DELAY_ENV = "K2_TEST_PREPARE_CHUNK_DELAY_S"


def _chunk_path(work: str, k: int) -> str:
    return os.path.join(work, f"chunk_{k:07d}.npz")


def committed_chunks(work: str) -> int:
    """How many chunks ``work`` holds (chunk 0, 1, ... without a gap)."""
    k = 0
    while os.path.isfile(_chunk_path(work, k)):
        k += 1
    return k


def commit_chunk(work: str, k: int, result: tuple) -> None:
    """Write chunk ``k`` (``(tokens, lengths, bad records, empty texts)``) into ``work``, atomically."""
    tokens, lengths, bad, empty = result
    tmp = _chunk_path(work, k) + ".tmp"
    with open(tmp, "wb") as f:
        np.savez(f, tokens=tokens, lengths=lengths, meta=np.array(json.dumps({"bad": bad, "empty": empty})))
    os.replace(tmp, _chunk_path(work, k))  # a chunk is either complete or absent


def _chunk_records(work: str, k: int) -> tuple[int, list, int]:
    """``(records, bad records, empty texts)`` of committed chunk ``k``, its tokens left unread: every
    record of a chunk is a document, a bad record or an empty text."""
    with np.load(_chunk_path(work, k), allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        return int(z["lengths"].size) + len(meta["bad"]) + int(meta["empty"]), meta["bad"], meta["empty"]


def _load_chunk(work: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, lengths)`` of committed chunk ``k`` (its counts: :func:`_chunk_records`)."""
    with np.load(_chunk_path(work, k), allow_pickle=False) as z:
        return z["tokens"], z["lengths"]


def bad_record_error(where: str, why: str) -> ConfigError:
    return ConfigError(
        f"{where}: bad record: {why}; fix the input, or set prepare.bad_records=skip to report and skip such records"
    )


def _committed_counts(work: str, done: int) -> tuple[int, int, int, list]:
    """``(records, bad records, empty texts, the first bad records)`` of the ``done`` chunks committed in
    ``work`` (a resumed build skips those records and counts those bad ones and empty texts again)."""
    skip = n_bad = n_empty = 0
    bad_list: list = []
    for k in range(done):
        records, bad, empty = _chunk_records(work, k)
        skip, n_bad, n_empty = skip + records, n_bad + len(bad), n_empty + empty
        bad_list.extend(bad[: MAX_REPORTED_BAD - len(bad_list)])
    return skip, n_bad, n_empty, bad_list


def _chunks(p: PrepareConfig, files: list[InputFile], done: int, skip: int) -> Iterator[tuple[tuple[int, int], list]]:
    """``((chunk index, input bytes read), [(file index, line, raw record), ...])`` per chunk of ``files``'
    records after the first ``skip``, numbered from ``done``: at most ``prepare.chunk_documents`` records,
    ended early by the record that brings the chunk's raw input to ``prepare.chunk_bytes`` bytes (or
    characters, for Parquet cells)."""
    chunk, chunk_bytes = int(p.chunk_documents), int(p.chunk_bytes)
    buf, size, k = [], 0, done
    for fi, line, raw, pos in read_records(files, str(p.text_key), str(p.text_document), skip=skip):
        buf.append((fi, line, raw))
        size += len(raw)
        if len(buf) == chunk or size >= chunk_bytes:
            yield (k, pos), buf
            buf, size, k = [], 0, k + 1
    if buf:
        yield (k, sum(f.bytes for f in files)), buf


def tokenize_chunks(
    p: PrepareConfig,
    files: list[InputFile],
    work: str,
    tok_path: str,
    dtype,
    progress: bool,
    log: Callable[[str], None],
    desc: str = "k2-data: tokenize",
) -> tuple[int, int, list]:
    """Tokenize every chunk of ``files``' records not yet committed in ``work``.

    Args:
        p: ``prepare.*`` (chunk sizes, workers, text key and document mode, the bad-record policy).
        files: the inputs in order (whole files or ranges); work: the chunks' directory (exists).
        tok_path: the ``tokenizer.json``; dtype: the ``.bin`` token dtype.
        progress: show a progress bar (bytes read, documents/s, tokens/s) on stderr.

    Returns:
        ``(bad records, empty texts, the first bad records [[where, why], ...])`` of all the chunks.

    Raises:
        ConfigError: the first bad record with ``prepare.bad_records=error``; an unreadable input.
    """
    from tqdm import tqdm

    done = committed_chunks(work)
    skip, n_bad, n_empty, bad_list = _committed_counts(work, done)
    if done:
        log(f"k2-data: resuming the build in {work}: {done} chunks ({skip:,} records) already tokenized")
    files_bytes = sum(f.bytes for f in files)
    initargs = (tok_path, [f.where for f in files], [f.kind for f in files], str(p.text_key), np.dtype(dtype).name)
    delay = float(os.environ.get(DELAY_ENV) or 0)
    pool = TokenizerPool(int(p.workers), initargs)
    t0, docs, toks, printed = time.time(), 0, 0, 0
    try:
        with tqdm(
            total=files_bytes,
            unit="B",
            unit_scale=True,
            desc=desc,
            disable=not progress,
            file=sys.stderr,
            dynamic_ncols=True,
        ) as bar:
            for (k, pos), result in pool.map_ordered(_chunks(p, files, done, skip)):
                tokens, lengths, bad, empty = result
                if bad and p.bad_records == "error":
                    raise bad_record_error(*bad[0])
                for where, why in bad:
                    if printed < _MAX_PRINTED_BAD:
                        log(f"k2-data: skipped bad record {where}: {why}")
                    printed += 1
                commit_chunk(work, k, result)
                if delay:
                    time.sleep(delay)
                n_bad, n_empty = n_bad + len(bad), n_empty + empty
                bad_list.extend([list(b) for b in bad[: MAX_REPORTED_BAD - len(bad_list)]])
                docs, toks = docs + lengths.size, toks + int(tokens.size)
                dt = max(time.time() - t0, 1e-9)
                bar.update(max(0, pos - bar.n))
                bar.set_postfix_str(f"{docs / dt:,.0f} docs/s, {toks / dt:,.0f} tokens/s", refresh=False)
    finally:
        pool.close()
    if printed > _MAX_PRINTED_BAD:
        log(f"k2-data: ... {printed - _MAX_PRINTED_BAD} more bad records skipped (all counted in the manifest)")
    return n_bad, n_empty, bad_list


def write_datasets(
    work: str, out: str, name: Callable[[int], str], dtype, shard_documents: int | None
) -> tuple[list, dict]:
    """Write the committed chunks of ``work`` into the directory ``out`` (which exists) as one megatron
    indexed dataset, or shards of ``shard_documents`` documents, named ``name(shard index)``, in the memory
    of one chunk whatever the corpus size.

    Returns:
        ``(datasets [{prefix, documents, tokens}], outputs {file name: {"size": bytes, "xxh3_64": hex}})``.
    """
    from k2.launcher.datasets.indexed_writer import IndexedDatasetWriter

    datasets: list = []
    outputs: dict = {}
    writer = None

    def finish():
        if writer is not None:
            writer.finalize()
            outputs.update(writer.outputs)
            datasets.append(
                {"prefix": os.path.basename(writer.prefix), "documents": writer.documents, "tokens": writer.tokens}
            )

    for k in range(committed_chunks(work)):
        tokens, lengths = _load_chunk(work, k)
        ends = np.concatenate([[0], np.cumsum(lengths)])
        lo = 0  # the first document of this chunk not yet written
        while lo < lengths.size:
            if writer is None or (shard_documents is not None and writer.documents == shard_documents):
                finish()
                writer = IndexedDatasetWriter(os.path.join(out, name(len(datasets))), dtype)
            hi = lengths.size if shard_documents is None else min(lengths.size, lo + shard_documents - writer.documents)
            writer.add_documents(tokens[ends[lo] : ends[hi]], lengths[lo:hi])
            lo = hi
    finish()
    return datasets, outputs


def remove_chunks(work: str) -> None:
    """Remove the chunks' directory ``work`` (its datasets are written)."""
    shutil.rmtree(work, ignore_errors=True)
