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
  (documents, tokens, the sha256 of every input and of the tokenizer, the datasets written, and every
  output file with its size and xxh3-64 checksum: what ``k2-data verify`` and ``data.verify`` check);
* parallel and resumable: :mod:`k2.launcher.datasets.chunked` (chunks tokenized by ``prepare.workers``
  processes, committed in input order into ``PREFIX.partial/``: the output bytes do not depend on the
  number of workers, and a build killed at any point and run again with the same settings and inputs
  continues after the last committed chunk and writes the same bytes as an uninterrupted build); across
  machines, ``prepare.tasks``: :mod:`k2.launcher.datasets.array_build`;
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from k2.config.errors import ConfigError
from k2.launcher.checksums import file_entries
from k2.launcher.datasets.chunked import bad_record_error, tokenize_chunks, write_datasets
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
from k2.launcher.datasets.tokenizer import HFTokenizer, load_user_tokenizer, train_byte_level_bpe

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = [
    "MANIFEST_SUFFIX",
    "PREPARE_FORMAT",
    "PreparedCorpus",
    "build_manifest",
    "build_manifest_path",
    "document_texts",
    "files_named",
    "output_prefix",
    "prepare_corpus",
    "prepared",
    "publish",
    "read_json",
    "settings",
    "settings_key",
    "tokenizer_entry",
    "trained_tokenizer",
    "unfinished_build",
    "user_tokenizer",
    "work_dir",
    "write_json",
]

# bump when the output layout or tokenization changes (forces a rebuild); 2: the manifest records every
# output's size and xxh3-64 checksum
PREPARE_FORMAT = 2
WORK_SUFFIX = ".partial"
MANIFEST_SUFFIX = ".manifest.json"


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
    found = build_manifest_path(prefix, cache)
    return None if found is None else found[1]


def build_manifest_path(prefix: str, cache: dict | None = None) -> tuple[str, dict] | None:
    """``(path, manifest)`` of :func:`build_manifest`, or None."""
    name = os.path.basename(prefix)
    cache = {} if cache is None else cache
    for c in _build_prefixes(prefix):
        path = c + MANIFEST_SUFFIX
        if path not in cache:
            cache[path] = read_json(path)
        manifest = cache[path]
        if manifest is not None and any(d.get("prefix") == name for d in manifest.get("datasets", [])):
            return path, manifest
    return None


# --------------------------------------------------------------------------- settings and state


def output_prefix(cfg: K2Config) -> str:
    """``prepare.output`` as an absolute dataset prefix (a trailing ``.bin`` / ``.idx`` dropped).

    Raises:
        ConfigError: ``prepare.output`` is null.
    """
    if cfg.prepare.output is None or not str(cfg.prepare.output).strip():
        raise ConfigError(
            "prepare.output is null: give the dataset prefix of the build (prepare.output=/data/corpus_text_document)"
        )
    prefix = os.path.abspath(os.path.expanduser(str(cfg.prepare.output)))
    for suffix in (".bin", ".idx", MANIFEST_SUFFIX):
        if prefix.endswith(suffix):
            prefix = prefix[: -len(suffix)]
    return prefix


def settings(cfg: K2Config) -> tuple[str, list[InputFile]]:
    """``(prefix, input files)`` of ``prepare.output`` (:func:`output_prefix`) / ``prepare.input``."""
    p = cfg.prepare
    prefix = output_prefix(cfg)
    files = expand_inputs(p.input)
    if prefix + WORK_SUFFIX in {os.path.dirname(f.path) for f in files}:
        raise ConfigError(f"prepare.input includes the build directory {prefix + WORK_SUFFIX}")
    return prefix, files


def user_tokenizer(cfg: K2Config) -> HFTokenizer | None:
    """``data.tokenizer`` loaded and checked against ``model.vocab_size``, or None (train one: then
    ``data.vocab_size`` must fit ``model.vocab_size``)."""
    if cfg.data.tokenizer is None:
        if int(cfg.data.vocab_size) > int(cfg.model.vocab_size):
            raise ConfigError(
                f"data.vocab_size={cfg.data.vocab_size} (the tokenizer trained on prepare.input) "
                f"exceeds model.vocab_size={cfg.model.vocab_size}; lower data.vocab_size or raise "
                f"model.vocab_size"
            )
        return None
    return load_user_tokenizer(cfg.data.tokenizer, int(cfg.model.vocab_size))


def settings_key(cfg: K2Config, user_tok: HFTokenizer | None) -> dict:
    """The settings the output depends on (besides the inputs): a build with others is not reused."""
    p = cfg.prepare
    return {
        "format": PREPARE_FORMAT,
        "text_key": str(p.text_key),
        "text_document": str(p.text_document),
        "bad_records": str(p.bad_records),
        "chunk_documents": int(p.chunk_documents),
        "chunk_bytes": int(p.chunk_bytes),
        "shard_documents": None if p.shard_documents is None else int(p.shard_documents),
        "tokenizer": (
            {"trained": False, "sha256": user_tok.unique_identifiers["sha256"]}
            if user_tok is not None
            else {"trained": True, "vocab_size": int(cfg.data.vocab_size)}
        ),
    }


def _key(cfg: K2Config, files: list[InputFile], hashes: list[str], user_tok: HFTokenizer | None) -> dict:
    """What the output depends on: a build (finished or not) with another key is not reused."""
    return {
        **settings_key(cfg, user_tok),
        "inputs": [{"path": f.path, "bytes": f.bytes, "sha256": h} for f, h in zip(files, hashes)],
    }


def read_json(path: str) -> dict | None:
    """The JSON object in ``path``, or None when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` into ``path`` atomically (a temporary name, then a rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _finished(prefix: str, key: dict) -> dict | None:
    """The manifest of a finished build of ``prefix`` with this key whose outputs are intact, or None."""
    manifest = read_json(prefix + MANIFEST_SUFFIX)
    if manifest is None or manifest.get("key") != key or unfinished_build(prefix):
        return None
    d = os.path.dirname(prefix)
    for name, entry in manifest.get("outputs", {}).items():
        p = os.path.join(d, name)
        if not isinstance(entry, dict) or not os.path.isfile(p) or os.path.getsize(p) != entry.get("size"):
            return None
    return manifest


# --------------------------------------------------------------------------- the build


def tokenizer_entry(tok, path: str, *, trained: bool) -> dict:
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


def _open_work_dir(prefix: str, key: dict, log: Callable[[str], None]) -> str:
    """The work directory of ``prefix``'s build with ``key``: the one there if it holds that build, else anew."""
    work = work_dir(prefix)
    if read_json(os.path.join(work, "build.json")) != key:
        if os.path.isdir(work):
            log(f"k2-data: {work} holds a build of other inputs or settings: starting over")
            shutil.rmtree(work)
        os.makedirs(work)
        write_json(os.path.join(work, "build.json"), key)
    return work


def prepare_corpus(
    cfg: K2Config, *, progress: bool | None = None, log: Callable[[str], None] = lambda s: print(s, flush=True)
) -> PreparedCorpus:
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
    prefix, files = settings(cfg)
    user_tok = user_tokenizer(cfg)
    hashes = [file_sha256(f.path) for f in files]
    key = _key(cfg, files, hashes, user_tok)
    manifest = _finished(prefix, key)
    if manifest is not None:
        log(f"k2-data: {prefix} is up to date (its manifest matches the inputs and settings): nothing rebuilt")
        return prepared(prefix, manifest, rebuilt=False)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with file_lock(os.path.join(os.path.dirname(prefix), f".{os.path.basename(prefix)}.lock"), remove=True):
        work = _open_work_dir(prefix, key, log)
        tok_path = (
            user_tok.path
            if user_tok is not None
            else trained_tokenizer(cfg, lambda: document_texts(cfg, files), work, log, "the input")
        )
        tok = user_tok if user_tok is not None else HFTokenizer(tok_path)
        dtype = token_dtype(tok.vocab_size)
        show = bool(p.progress) if progress is None else progress
        n_bad, n_empty, bad_list = tokenize_chunks(p, files, work, tok_path, dtype, show, log)
        datasets, outputs = _assemble(prefix, work, tok_path if user_tok is None else None, dtype, p.shard_documents)
        documents = sum(d["documents"] for d in datasets)
        if documents == 0:
            shutil.rmtree(work, ignore_errors=True)
            raise ConfigError(
                f"prepare.input holds no document ({files_named(files)}"
                f"{f'; {n_bad} bad records skipped' if n_bad else ''}"
                f"{f'; {n_empty} empty texts' if n_empty else ''})"
            )
        manifest = {
            "key": key,
            "documents": documents,
            "tokens": sum(d["tokens"] for d in datasets),
            "empty_documents_skipped": n_empty,
            "bad_records": {"policy": str(p.bad_records), "count": n_bad, "first": bad_list},
            "inputs": key["inputs"],
            "tokenizer": tokenizer_entry(
                tok, tok_path if user_tok is not None else prefix + ".tokenizer.json", trained=user_tok is None
            ),
            "token_dtype": np.dtype(dtype).name,
            "datasets": datasets,
            "outputs": outputs,
            "build_seconds": round(time.time() - t0, 2),
        }
        publish(prefix, os.path.join(work, "out"), outputs, manifest)
        shutil.rmtree(work)
    log(f"k2-data: built {prefix} in {time.time() - t0:.1f} s")
    return prepared(prefix, manifest, rebuilt=True)


def prepared(prefix: str, manifest: dict, rebuilt: bool) -> PreparedCorpus:
    """The :class:`PreparedCorpus` of the build of ``prefix`` whose manifest is ``manifest``."""
    d = os.path.dirname(prefix)
    return PreparedCorpus(
        [os.path.join(d, x["prefix"]) for x in manifest["datasets"]],
        manifest["tokenizer"]["path"],
        prefix + MANIFEST_SUFFIX,
        manifest,
        rebuilt,
    )


def document_texts(cfg: K2Config, files: list[InputFile], max_bytes: int | None = None):
    """Document texts of ``files`` (whole files or ranges), streamed, for training the tokenizer (bad
    records per the policy); with ``max_bytes``, those of the first records until they hold ``max_bytes``
    bytes of input (characters, for Parquet cells; at least one record)."""
    p = cfg.prepare
    held = 0
    for fi, line, raw, _ in read_records(files, str(p.text_key), str(p.text_document)):
        held += len(raw)
        try:
            text = record_text(files[fi].where, files[fi].kind, line, raw, str(p.text_key))
        except BadRecord as e:
            if p.bad_records == "error":
                raise bad_record_error(e.where, e.why) from None
            continue
        if text:
            yield text
        if max_bytes is not None and held >= max_bytes:
            return


def trained_tokenizer(cfg: K2Config, texts, work: str, log, what: str) -> str:
    """``<work>/tokenizer.json``: a byte-level BPE of ``data.vocab_size`` ids trained once on the texts
    ``texts()`` yields (``what`` names them in the log line); a resumed build reuses it."""
    path = os.path.join(work, "tokenizer.json")
    if os.path.isfile(path):
        return path
    vocab = int(cfg.data.vocab_size)
    log(f"k2-data: training a byte-level BPE tokenizer of {vocab} ids on {what} (data.tokenizer=null)")
    texts = texts()
    first = next(texts, None)
    if first is None:
        raise ConfigError(f"prepare.input holds no document to train a tokenizer on ({files_named(settings(cfg)[1])})")
    tok = train_byte_level_bpe(_chain(first, texts), vocab)
    tok.save(path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def files_named(files: list[InputFile]) -> str:
    """``"2 files: a.jsonl, b.jsonl"`` (the first three named) for the messages."""
    more = " ..." if len(files) > 3 else ""
    return f"{len(files)} file{'' if len(files) == 1 else 's'}: {', '.join(f.path for f in files[:3])}{more}"


def _chain(first, rest):
    yield first
    yield from rest


def _assemble(prefix, work, trained_tok, dtype, shard_documents) -> tuple[list, dict]:
    """Write the datasets from the committed chunks into ``PREFIX.partial/out/`` (one megatron indexed
    dataset, or shards of ``shard_documents`` documents: :func:`k2.launcher.datasets.chunked.write_datasets`),
    and the trained tokenizer beside them. Returns ``(datasets [{prefix, documents, tokens}], outputs
    {name: {"size", "xxh3_64"}})``."""
    base = os.path.basename(prefix)
    out = os.path.join(work, "out")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    datasets, outputs = write_datasets(
        work, out, lambda i: f"{base}_{i:05d}" if shard_documents is not None else base, dtype, shard_documents
    )
    if trained_tok is not None:
        shutil.copyfile(trained_tok, os.path.join(out, base + ".tokenizer.json"))
        outputs.update(file_entries(out, [base + ".tokenizer.json"]))
    return datasets, dict(sorted(outputs.items()))


def publish(prefix: str, out: str, outputs: dict, manifest: dict) -> None:
    """Move the assembled files ``outputs`` from ``out`` into place (the files of an earlier build of
    ``prefix`` removed first), then write the manifest. The caller removes the work directory after:
    killed half-way, the work directory is still there (so the prefix is refused as unfinished) and the
    next run assembles and publishes again."""
    d = os.path.dirname(prefix)
    if os.path.exists(prefix + MANIFEST_SUFFIX):
        os.remove(prefix + MANIFEST_SUFFIX)
    esc = glob.escape(prefix)
    for old in (
        glob.glob(esc + ".bin")
        + glob.glob(esc + ".idx")
        + glob.glob(esc + "_[0-9][0-9][0-9][0-9][0-9].*")
        + glob.glob(esc + ".tokenizer.json")
    ):
        os.remove(old)
    for name in outputs:
        os.replace(os.path.join(out, name), os.path.join(d, name))
    write_json(prefix + MANIFEST_SUFFIX, manifest)
