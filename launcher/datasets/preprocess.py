"""``k2-data prepare.input=...``: tokenize a raw-text corpus into megatron indexed datasets.

What megatron-LM's ``tools/preprocess_data.py`` does (it is not part of the megatron-core package), with
the properties a long build on a shared cluster needs:

* inputs and records: :mod:`k2.launcher.datasets.sources` (JSONL / Parquet / text, compressed or not);
* the tokenizer: ``data.tokenizer`` (a HF ``tokenizer.json``) or a byte-level BPE of ``data.vocab_size``
  ids trained on the input first (:func:`k2.launcher.datasets.tokenizer.train_byte_level_bpe`);
* output: megatron-core's indexed-dataset format (``PREFIX.bin`` / ``PREFIX.idx``, or shards
  ``PREFIX_00000.bin/.idx``, ... of ``prepare.shard_documents`` documents), each document's ids followed
  by one end-of-document (EOD) token, written in constant memory by
  :class:`k2.launcher.datasets.indexed_writer.IndexedDatasetWriter` (the same bytes as megatron-core's
  ``IndexedDatasetBuilder``, whose memory grows with the documents), and ``PREFIX.manifest.json``
  (documents, tokens, the sha256 of every input and of the tokenizer, the datasets written);
* parallel: the records are read in order by one process and tokenized in chunks of
  ``prepare.chunk_documents`` records (fewer where they reach ``prepare.chunk_bytes`` bytes of input:
  the memory of a chunk is bounded whatever the document size) by ``prepare.workers`` processes;
  chunks are written in input order, so the output bytes do not depend on the number of workers;
* resumable: every tokenized chunk is committed (written, then renamed) into ``PREFIX.partial/``; a
  build killed at any point and run again with the same settings and inputs continues after the last
  committed chunk and writes the same bytes as an uninterrupted build;
* never complete-looking when killed: the datasets are assembled inside ``PREFIX.partial/`` and moved
  into place at the end, the manifest last; while ``PREFIX.partial/`` exists the prefix is an unfinished
  build, which :func:`k2.launcher.datasets.resolve.resolve_data` refuses.

Units: a document is one record (a JSONL line, a Parquet row, a text file or paragraph); tokens are ids.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from k2.config.errors import ConfigError
from k2.launcher.datasets.idx_format import token_dtype
from k2.launcher.datasets.locks import file_lock
from k2.launcher.datasets.sources import (
    BadRecord,
    InputFile,
    expand_inputs,
    file_sha256,
    read_records,
    record_text,
)
from k2.launcher.datasets.tokenize_pool import TokenizerPool
from k2.launcher.datasets.tokenizer import HFTokenizer, load_user_tokenizer, train_byte_level_bpe

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = ["PREPARE_FORMAT", "PreparedCorpus", "build_manifest", "prepare_corpus", "unfinished_build", "work_dir"]

PREPARE_FORMAT = 1  # bump when the output layout or tokenization changes (forces a rebuild)
WORK_SUFFIX = ".partial"
_MAX_REPORTED_BAD = 100  # bad records listed in the manifest (all are counted)
_MAX_PRINTED_BAD = 20


@dataclass
class PreparedCorpus:
    """The result of :func:`prepare_corpus`.

    Attributes:
        prefixes: the dataset prefixes written, in order (one, or one per shard): ``data.path``.
        tokenizer_path: the tokenizer the ids come from (``data.tokenizer``).
        manifest_path: ``PREFIX.manifest.json``; manifest: its content.
        rebuilt: False when an up-to-date build was found and nothing was written.
    """

    prefixes: list
    tokenizer_path: str
    manifest_path: str
    manifest: dict = field(default_factory=dict)
    rebuilt: bool = True


def work_dir(prefix: str) -> str:
    """``PREFIX.partial``: the committed chunks and the assembly of an unfinished build of ``prefix``."""
    return prefix + WORK_SUFFIX


def _build_prefixes(prefix: str) -> list[str]:
    """The prefixes of the ``k2-data`` builds that may have written ``prefix``: itself, and ``BASE`` when
    it is the shard ``BASE_NNNNN``."""
    candidates = [prefix]
    base, _, num = prefix.rpartition("_")
    if base and len(num) == 5 and num.isdigit():
        candidates.append(base)
    return candidates


def unfinished_build(prefix: str) -> str | None:
    """The work directory of an unfinished ``k2-data`` build that writes ``prefix`` (itself, or the shard
    ``BASE_NNNNN`` of ``BASE``), or None."""
    for c in _build_prefixes(prefix):
        if os.path.isdir(work_dir(c)):
            return work_dir(c)
    return None


def build_manifest(prefix: str, cache: dict | None = None) -> dict | None:
    """The manifest of the finished ``k2-data`` build that wrote the dataset ``prefix`` (``PREFIX`` or
    the shard's ``BASE.manifest.json``, listing it among its datasets), or None (not written by
    ``k2-data prepare``, or its manifest is unreadable). ``cache``: manifests already read, by path
    (filled here), so that the shards of one build read its manifest once."""
    name = os.path.basename(prefix)
    cache = {} if cache is None else cache
    for c in _build_prefixes(prefix):
        path = c + ".manifest.json"
        if path not in cache:
            cache[path] = _read_json(path)
        manifest = cache[path]
        if manifest is not None and any(d.get("prefix") == name for d in manifest.get("datasets", [])):
            return manifest
    return None


# --------------------------------------------------------------------------- settings and state


def _settings(cfg: K2Config) -> tuple[str, list[InputFile]]:
    p = cfg.prepare
    prefix = os.path.abspath(os.path.expanduser(str(p.output)))
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            prefix = prefix[: -len(suffix)]
    files = expand_inputs(p.input)
    if prefix + WORK_SUFFIX in {os.path.dirname(f.path) for f in files}:
        raise ConfigError(f"prepare.input includes the build directory {prefix + WORK_SUFFIX}")
    return prefix, files


def _user_tokenizer(cfg: K2Config) -> HFTokenizer | None:
    """``data.tokenizer`` loaded and checked against ``model.vocab_size``, or None (train one)."""
    if cfg.data.tokenizer is None:
        return None
    return load_user_tokenizer(cfg.data.tokenizer, int(cfg.model.vocab_size))


def _key(cfg: K2Config, files: list[InputFile], hashes: list[str], user_tok: HFTokenizer | None) -> dict:
    """What the output depends on: a build (finished or not) with another key is not reused."""
    p = cfg.prepare
    return {
        "format": PREPARE_FORMAT,
        "inputs": [{"path": f.path, "bytes": f.bytes, "sha256": h} for f, h in zip(files, hashes)],
        "text_key": str(p.text_key),
        "text_document": str(p.text_document),
        "bad_records": str(p.bad_records),
        "chunk_documents": int(p.chunk_documents),
        "chunk_bytes": int(p.chunk_bytes),
        "shard_documents": None if p.shard_documents is None else int(p.shard_documents),
        "tokenizer": ({"trained": False, "sha256": user_tok.unique_identifiers["sha256"]}
                      if user_tok is not None else {"trained": True, "vocab_size": int(cfg.data.vocab_size)}),
    }


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _finished(prefix: str, key: dict) -> dict | None:
    """The manifest of a finished build of ``prefix`` with this key whose outputs are intact, or None."""
    manifest = _read_json(prefix + ".manifest.json")
    if manifest is None or manifest.get("key") != key or unfinished_build(prefix):
        return None
    d = os.path.dirname(prefix)
    for name, size in manifest.get("outputs", {}).items():
        p = os.path.join(d, name)
        if not os.path.isfile(p) or os.path.getsize(p) != size:
            return None
    return manifest


def _chunk_path(work: str, k: int) -> str:
    return os.path.join(work, f"chunk_{k:07d}.npz")


def _committed_chunks(work: str) -> int:
    k = 0
    while os.path.isfile(_chunk_path(work, k)):
        k += 1
    return k


def _commit_chunk(work: str, k: int, result: tuple) -> None:
    tokens, lengths, bad, empty = result
    tmp = _chunk_path(work, k) + ".tmp"
    with open(tmp, "wb") as f:
        np.savez(f, tokens=tokens, lengths=lengths,
                 meta=np.array(json.dumps({"bad": bad, "empty": empty})))
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


# --------------------------------------------------------------------------- the build



def _tokenizer_entry(tok, path: str, *, trained: bool) -> dict:
    """The manifest's ``tokenizer`` entry: where it is, its sha256, vocab size and EOD, who made it."""
    import tokenizers

    return {
        "path": path,
        "sha256": tok.unique_identifiers["sha256"],
        "vocab_size": tok.vocab_size,
        "eod_id": tok.eod,
        "eod_token": tok.eod_token,
        "trained": trained,
        "tokenizers_version": tokenizers.__version__,
    }

def prepare_corpus(cfg: K2Config, *, progress: bool | None = None,
                   log: Callable[[str], None] = lambda s: print(s, flush=True)) -> PreparedCorpus:
    """Tokenize ``prepare.input`` into megatron indexed datasets at ``prepare.output`` (or reuse them).

    Every record becomes one document: the tokenizer's ids of its text (``add_special_tokens=False``)
    followed by the tokenizer's EOD id; empty texts are skipped (counted). A bad record (a line that is
    not a JSON object, lacks ``prepare.text_key`` or holds a non-string, a text that is not UTF-8) stops
    the build naming its file and line (``prepare.bad_records=error``) or is reported and skipped
    (``skip``). Resumable and deterministic: see the module docstring.

    Args:
        cfg: the full config (``prepare.*``, ``data.tokenizer``, ``data.vocab_size``, ``model.vocab_size``).
        progress: show the progress bar; None = ``prepare.progress``.
        log: where the status lines go.

    Returns:
        :class:`PreparedCorpus`.

    Raises:
        ConfigError: a bad ``prepare.*`` value, an input that matches nothing / is unreadable / of an
            unknown format, a Parquet file without the text column, the first bad record (with
            ``bad_records=error``), no document in the input, a tokenizer that is missing, has no EOD
            token, or more ids than ``model.vocab_size``.
    """
    t0 = time.time()
    p = cfg.prepare
    prefix, files = _settings(cfg)
    user_tok = _user_tokenizer(cfg)
    if user_tok is None and int(cfg.data.vocab_size) > int(cfg.model.vocab_size):
        raise ConfigError(f"data.vocab_size={cfg.data.vocab_size} (the tokenizer trained on prepare.input) "
                          f"exceeds model.vocab_size={cfg.model.vocab_size}; lower data.vocab_size or raise "
                          f"model.vocab_size")
    hashes = [file_sha256(f.path) for f in files]
    key = _key(cfg, files, hashes, user_tok)
    manifest = _finished(prefix, key)
    if manifest is not None:
        log(f"k2-data: {prefix} is up to date (its manifest matches the inputs and settings): nothing rebuilt")
        return _result(prefix, manifest, rebuilt=False)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with file_lock(os.path.join(os.path.dirname(prefix), f".{os.path.basename(prefix)}.lock"), remove=True):
        work = work_dir(prefix)
        if _read_json(os.path.join(work, "build.json")) != key:
            if os.path.isdir(work):
                log(f"k2-data: {work} holds a build of other inputs or settings: starting over")
                shutil.rmtree(work)
            os.makedirs(work)
            _write_json(os.path.join(work, "build.json"), key)
        tok_path = user_tok.path if user_tok is not None else _trained_tokenizer(cfg, files, work, log)
        tok = user_tok if user_tok is not None else HFTokenizer(tok_path)
        dtype = token_dtype(tok.vocab_size)
        n_bad, n_empty, bad_list = _tokenize_all(cfg, files, work, tok_path, dtype, progress, log)
        datasets, outputs = _assemble(prefix, work, tok_path if user_tok is None else None, dtype,
                                      p.shard_documents)
        documents = sum(d["documents"] for d in datasets)
        if documents == 0:
            shutil.rmtree(work, ignore_errors=True)
            raise ConfigError(f"prepare.input holds no document ({_files_named(files)}"
                              f"{f'; {n_bad} bad records skipped' if n_bad else ''}"
                              f"{f'; {n_empty} empty texts' if n_empty else ''})")
        manifest = {
            "key": key,
            "documents": documents,
            "tokens": sum(d["tokens"] for d in datasets),
            "empty_documents_skipped": n_empty,
            "bad_records": {"policy": str(p.bad_records), "count": n_bad, "first": bad_list},
            "inputs": key["inputs"],
            "tokenizer": _tokenizer_entry(tok, tok_path if user_tok is not None else prefix + ".tokenizer.json",
                                          trained=user_tok is None),
            "token_dtype": np.dtype(dtype).name,
            "datasets": datasets,
            "outputs": outputs,
            "build_seconds": round(time.time() - t0, 2),
        }
        _publish(prefix, work, outputs, manifest)
    log(f"k2-data: built {prefix} in {time.time() - t0:.1f} s")
    return _result(prefix, manifest, rebuilt=True)


def _result(prefix: str, manifest: dict, rebuilt: bool) -> PreparedCorpus:
    d = os.path.dirname(prefix)
    return PreparedCorpus([os.path.join(d, x["prefix"]) for x in manifest["datasets"]],
                          manifest["tokenizer"]["path"], prefix + ".manifest.json", manifest, rebuilt)


def _texts_for_training(cfg: K2Config, files: list[InputFile]):
    """Document texts of the input, streamed, for training the tokenizer (bad records per the policy)."""
    p = cfg.prepare
    for fi, line, raw, _ in read_records(files, str(p.text_key), str(p.text_document)):
        try:
            text = record_text(files[fi].path, files[fi].kind, line, raw, str(p.text_key))
        except BadRecord as e:
            if p.bad_records == "error":
                raise _bad_record_error(e.where, e.why) from None
            continue
        if text:
            yield text


def _trained_tokenizer(cfg: K2Config, files: list[InputFile], work: str, log) -> str:
    """``PREFIX.partial/tokenizer.json``: trained on the input once (a resumed build reuses it)."""
    path = os.path.join(work, "tokenizer.json")
    if os.path.isfile(path):
        return path
    vocab = int(cfg.data.vocab_size)
    log(f"k2-data: training a byte-level BPE tokenizer of {vocab} ids on the input (data.tokenizer=null)")
    texts = _texts_for_training(cfg, files)
    first = next(texts, None)
    if first is None:
        raise ConfigError(f"prepare.input holds no document to train a tokenizer on ({_files_named(files)})")
    tok = train_byte_level_bpe(_chain(first, texts), vocab)
    tok.save(path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def _files_named(files: list[InputFile]) -> str:
    """``"2 files: a.jsonl, b.jsonl"`` (the first three named) for the messages."""
    more = " ..." if len(files) > 3 else ""
    return f"{len(files)} file{'' if len(files) == 1 else 's'}: {', '.join(f.path for f in files[:3])}{more}"


def _chain(first, rest):
    yield first
    yield from rest


def _bad_record_error(where: str, why: str) -> ConfigError:
    return ConfigError(f"{where}: bad record: {why}; fix the input, or set prepare.bad_records=skip to "
                       f"report and skip such records")


def _tokenize_all(cfg: K2Config, files, work, tok_path, dtype, progress, log) -> tuple[int, int, list]:
    """Tokenize every chunk not yet committed; returns (bad records, empty texts, the first bad ones)."""
    from tqdm import tqdm

    p = cfg.prepare
    chunk, chunk_bytes = int(p.chunk_documents), int(p.chunk_bytes)
    done = _committed_chunks(work)
    n_bad = n_empty = skip = 0
    bad_list: list = []
    for k in range(done):  # the counts of the committed chunks
        records, bad, empty = _chunk_records(work, k)
        skip, n_bad, n_empty = skip + records, n_bad + len(bad), n_empty + empty
        bad_list.extend(bad[: _MAX_REPORTED_BAD - len(bad_list)])
    if done:
        log(f"k2-data: resuming the build in {work}: {done} chunks ({skip:,} records) already tokenized")

    def chunks():
        """Chunks of at most ``chunk`` records, ended early by the record that brings the chunk's raw
        input to ``chunk_bytes`` bytes (or characters, for Parquet cells)."""
        buf, size, k = [], 0, done
        for fi, line, raw, pos in read_records(files, str(p.text_key), str(p.text_document), skip=skip):
            buf.append((fi, line, raw))
            size += len(raw)
            if len(buf) == chunk or size >= chunk_bytes:
                yield (k, pos), buf
                buf, size, k = [], 0, k + 1
        if buf:
            yield (k, files_bytes), buf

    files_bytes = sum(f.bytes for f in files)
    show = bool(p.progress) if progress is None else progress
    initargs = (tok_path, [f.path for f in files], [f.kind for f in files], str(p.text_key),
                np.dtype(dtype).name)
    pool = TokenizerPool(int(p.workers), initargs)
    t0, docs, toks, printed = time.time(), 0, 0, 0
    try:
        with tqdm(total=files_bytes, unit="B", unit_scale=True, desc="k2-data: tokenize", disable=not show,
                  file=sys.stderr, dynamic_ncols=True) as bar:
            for (k, pos), result in pool.map_ordered(chunks()):
                tokens, lengths, bad, empty = result
                if bad and p.bad_records == "error":
                    raise _bad_record_error(*bad[0])
                for where, why in bad:
                    if printed < _MAX_PRINTED_BAD:
                        log(f"k2-data: skipped bad record {where}: {why}")
                    printed += 1
                _commit_chunk(work, k, result)
                n_bad, n_empty = n_bad + len(bad), n_empty + empty
                bad_list.extend([list(b) for b in bad[: _MAX_REPORTED_BAD - len(bad_list)]])
                docs, toks = docs + lengths.size, toks + int(tokens.size)
                dt = max(time.time() - t0, 1e-9)
                bar.update(max(0, pos - bar.n))
                bar.set_postfix_str(f"{docs / dt:,.0f} docs/s, {toks / dt:,.0f} tokens/s", refresh=False)
    finally:
        pool.close()
    if printed > _MAX_PRINTED_BAD:
        log(f"k2-data: ... {printed - _MAX_PRINTED_BAD} more bad records skipped (all counted in the manifest)")
    return n_bad, n_empty, bad_list


def _assemble(prefix, work, trained_tok, dtype, shard_documents) -> tuple[list, dict]:
    """Write the datasets from the committed chunks into ``PREFIX.partial/out/`` (one megatron indexed
    dataset, or shards of ``shard_documents`` documents), in memory of one chunk whatever the corpus size
    (:class:`k2.launcher.datasets.indexed_writer.IndexedDatasetWriter`). Returns ``(datasets [{prefix,
    documents, tokens}], outputs {name: bytes})``."""
    from k2.launcher.datasets.indexed_writer import IndexedDatasetWriter

    base = os.path.basename(prefix)
    out = os.path.join(work, "out")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    datasets: list = []
    writer = None

    def finish():
        if writer is not None:
            writer.finalize()
            datasets.append({"prefix": os.path.basename(writer.prefix), "documents": writer.documents,
                             "tokens": writer.tokens})

    for k in range(_committed_chunks(work)):
        tokens, lengths = _load_chunk(work, k)
        ends = np.concatenate([[0], np.cumsum(lengths)])
        lo = 0  # the first document of this chunk not yet written
        while lo < lengths.size:
            if writer is None or (shard_documents is not None and writer.documents == shard_documents):
                finish()
                name = f"{base}_{len(datasets):05d}" if shard_documents is not None else base
                writer = IndexedDatasetWriter(os.path.join(out, name), dtype)
            hi = lengths.size if shard_documents is None else min(lengths.size,
                                                                  lo + shard_documents - writer.documents)
            writer.add_documents(tokens[ends[lo]:ends[hi]], lengths[lo:hi])
            lo = hi
    finish()
    if trained_tok is not None:
        shutil.copyfile(trained_tok, os.path.join(out, base + ".tokenizer.json"))
    outputs = {n: os.path.getsize(os.path.join(out, n)) for n in sorted(os.listdir(out))}
    return datasets, outputs


def _publish(prefix: str, work: str, outputs: dict, manifest: dict) -> None:
    """Move the assembled files into place, then the manifest, then remove the work directory. Killed
    half-way, the work directory is still there (so the prefix is refused as unfinished) and the next
    run assembles and publishes again."""
    d = os.path.dirname(prefix)
    if os.path.exists(prefix + ".manifest.json"):
        os.remove(prefix + ".manifest.json")
    esc = glob.escape(prefix)
    for old in glob.glob(esc + ".bin") + glob.glob(esc + ".idx") + glob.glob(esc + "_[0-9][0-9][0-9][0-9][0-9].*") \
            + glob.glob(esc + ".tokenizer.json"):
        os.remove(old)
    for name in outputs:
        os.replace(os.path.join(work, "out", name), os.path.join(d, name))
    _write_json(prefix + ".manifest.json", manifest)
    shutil.rmtree(work)
