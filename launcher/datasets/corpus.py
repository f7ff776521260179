"""The embedded default corpus: the running interpreter's standard-library ``*.py`` files, a byte-level BPE
tokenizer trained on them, and megatron indexed datasets (``train`` / ``valid`` ``.bin`` / ``.idx``).

:func:`prepare_stdlib_corpus` builds it once (idempotent, crash-safe: built under a temporary name and
renamed into place last, serialised with a file lock) into ``<data.cache_dir>/stdlib-<pyver>-v<vocab>/``;
``k2-data`` runs it. Units: a document is one source file; tokens are tokenizer ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from k2.config.validate import check_data
from k2.launcher.checksums import file_entries
from k2.launcher.datasets.idx_format import token_dtype
from k2.launcher.datasets.indexed_writer import IndexedDatasetWriter
from k2.launcher.datasets.locks import file_lock
from k2.launcher.datasets.tokenizer import EOD_TOKEN, PAD_TOKEN, train_byte_level_bpe
from k2.launcher.progress import moved

if TYPE_CHECKING:
    from k2.config.schema import DataConfig

# bump when the corpus layout or tokenization changes (forces a rebuild); 2: the manifest records every
# output's size and xxh3-64 checksum (``k2-data verify``, ``data.verify``)
CORPUS_FORMAT = 2
_ENCODE_CHUNK = 64  # documents per tokenizers.encode_batch call (parallel inside tokenizers)


@dataclass
class CorpusPaths:
    """Where the embedded corpus lives.

    Attributes:
        train_prefix: megatron indexed-dataset prefix of the training split (``PREFIX.bin/.idx``).
        valid_prefix: prefix of the held-out validation split (whole files, disjoint from train).
        tokenizer_path: the byte-level BPE ``tokenizer.json`` trained on the training split.
        directory: ``<data.cache_dir>/stdlib-<pyver>-v<vocab>``.
        manifest: the parsed ``manifest.json`` (counts, hashes, file lists per split).
        rebuilt: True if this call built the corpus, False if an up-to-date one was reused.
    """

    train_prefix: str
    valid_prefix: str
    tokenizer_path: str
    directory: str = ""
    manifest: dict = field(default_factory=dict)
    rebuilt: bool = False


def default_stdlib_dir() -> str:
    """The running interpreter's standard-library directory (``sysconfig`` ``stdlib`` path)."""
    return sysconfig.get_paths()["stdlib"]


def list_stdlib_files(stdlib_dir: str | None = None) -> list[str]:
    """All ``*.py`` files under the stdlib directory, recursively, as sorted POSIX relative paths.

    ``site-packages`` / ``dist-packages`` (third-party code) and ``__pycache__`` are skipped; symlinked
    directories are not followed. The order is deterministic (sorted relative path).
    """
    root = stdlib_dir or default_stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _decode(raw: bytes) -> tuple[str, bool]:
    """File bytes -> document text. UTF-8, else latin-1 (lossless for any bytes). Returns (text, is_utf8)."""
    try:
        return raw.decode("utf-8"), True
    except UnicodeDecodeError:
        return raw.decode("latin-1"), False


def _is_valid_doc(relpath: str, valid_fraction: float) -> bool:
    """Deterministic held-out assignment: a hash of the relative path, uniform in [0, 1)."""
    return _valid_score(relpath) < valid_fraction


def _valid_score(relpath: str) -> float:
    digest = hashlib.sha256(("k2-valid:" + relpath).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _python_version() -> str:
    return platform.python_version()


def stdlib_corpus_dir(data_cfg: DataConfig) -> str:
    """Absolute ``<data.cache_dir>/stdlib-<python version>-v<data.vocab_size>`` (may not exist yet)."""
    cache_dir = os.path.abspath(os.path.expanduser(str(data_cfg.cache_dir)))
    return os.path.join(cache_dir, f"stdlib-{_python_version()}-v{int(data_cfg.vocab_size)}")


def _source_key(stdlib_dir: str, files: Sequence[str]):
    """Read every file once; return (texts, utf8 flags, content sha256 of paths + bytes)."""
    h = hashlib.sha256()
    texts, utf8 = [], []
    for rel in files:
        with open(os.path.join(stdlib_dir, rel), "rb") as f:
            raw = f.read()
        h.update(rel.encode("utf-8") + b"\0" + len(raw).to_bytes(8, "little"))
        h.update(raw)
        text, ok = _decode(raw)
        texts.append(text)
        utf8.append(ok)
    return texts, utf8, h.hexdigest()


def _expected(vocab_size: int, valid_fraction: float, source_sha256: str) -> dict:
    return {
        "format": CORPUS_FORMAT,
        "python_version": _python_version(),
        "vocab_size": vocab_size,
        "valid_fraction": valid_fraction,
        "source_sha256": source_sha256,
    }


def _read_matching_manifest(directory: str, expected: dict) -> dict | None:
    """The manifest of ``directory`` if it matches ``expected`` and every output file is intact."""
    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if any(manifest.get(k) != v for k, v in expected.items()):
        return None
    for name, meta in manifest.get("outputs", {}).items():
        p = os.path.join(directory, name)
        if not os.path.isfile(p) or not isinstance(meta, dict) or os.path.getsize(p) != meta.get("size"):
            return None
    return manifest


def _paths(directory: str, manifest: dict, rebuilt: bool) -> CorpusPaths:
    return CorpusPaths(
        train_prefix=os.path.join(directory, "train"),
        valid_prefix=os.path.join(directory, "valid"),
        tokenizer_path=os.path.join(directory, "tokenizer.json"),
        directory=directory,
        manifest=manifest,
        rebuilt=rebuilt,
    )


def _encode_chunk(tok, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of a chunk of documents (no EOD; ``encode_batch_fast``: without the unused character
    offsets). Separate function so tests can inject a crash."""
    return [e.ids for e in tok.encode_batch_fast(list(texts), add_special_tokens=False)]


def prepare_stdlib_corpus(
    data_cfg: DataConfig, *, progress: bool = True, verbose: bool = True, stdlib_dir: str | None = None
) -> CorpusPaths:
    """Build the embedded stdlib corpus into ``<data.cache_dir>/stdlib-<pyver>-v<vocab>/`` (or reuse it).

    Every ``*.py`` file of the running interpreter's standard library (sorted, ``site-packages``
    skipped) is one document: its text (UTF-8; latin-1 for the few files that are not UTF-8) encoded
    with a byte-level BPE tokenizer of ``data.vocab_size`` ids (special tokens ``<|endoftext|>`` = EOD,
    ``<|pad|>``) trained on the training files, followed by one EOD token. Files go to the validation
    split by a hash of their relative path (about ``data.valid_fraction`` of them, at least one).

    Output: ``tokenizer.json``, ``train.bin/.idx``, ``valid.bin/.idx`` (megatron-core's indexed-dataset
    format, written by :class:`k2.launcher.datasets.indexed_writer.IndexedDatasetWriter`: the bytes of
    megatron's ``IndexedDatasetBuilder`` without importing torch; token dtype uint16 below 65,500 ids)
    and ``manifest.json``. The directory is built under a temporary name and renamed into place last, so
    an interrupted build never leaves a complete-looking directory; the next build removes the
    leftovers. Builds are serialised with a file lock, so concurrent callers (e.g. several ranks) build
    once.

    Idempotent: when ``manifest.json`` matches (format, Python version, vocab size, valid fraction and
    a sha256 of all source paths + bytes) and the outputs are intact, nothing is rewritten.

    Args:
        data_cfg: the ``data`` config node (``cache_dir``, ``vocab_size``, ``valid_fraction`` are read).
        progress: show a tqdm bar while tokenizing.
        verbose: print what is done (built or reused).
        stdlib_dir: override the source directory (tests); default ``sysconfig`` ``stdlib``.

    Returns:
        :class:`CorpusPaths` of the ready corpus.

    Raises:
        ConfigError: ``data.vocab_size`` < 258 or ``data.valid_fraction`` outside (0, 1).
    """
    check_data(data_cfg)  # the config layer's rules for the embedded corpus (callers may pass any node)
    vocab_size = int(data_cfg.vocab_size)
    valid_fraction = float(data_cfg.valid_fraction)
    src = os.path.abspath(stdlib_dir or default_stdlib_dir())
    directory = stdlib_corpus_dir(data_cfg)
    cache_dir, name = os.path.split(directory)

    t0 = time.time()
    files = list_stdlib_files(src)
    if len(files) < 2:
        raise RuntimeError(f"found {len(files)} *.py files under {src}; the stdlib corpus needs >= 2")
    texts, utf8, source_sha = _source_key(src, files)
    expected = _expected(vocab_size, valid_fraction, source_sha)

    manifest = _read_matching_manifest(directory, expected)
    if manifest is None:
        with file_lock(os.path.join(cache_dir, f".{name}.lock")):
            manifest = _read_matching_manifest(directory, expected)  # another process built it
            if manifest is None:
                _remove_leftovers(cache_dir, name)
                manifest = _build_corpus(directory, src, files, texts, utf8, expected, progress, verbose, t0)
                return _paths(directory, manifest, rebuilt=True)
    if verbose:
        print(
            f"k2-data: stdlib corpus is up to date at {directory} (manifest matches); skipped rebuilding",
            flush=True,
        )
    return _paths(directory, manifest, rebuilt=False)


def _remove_leftovers(cache_dir: str, name: str) -> None:
    """Temp/old directories of earlier builds that died (only called while holding the build lock)."""
    for entry in os.listdir(cache_dir):
        if entry.startswith((f".{name}.tmp-", f".{name}.old-")):
            shutil.rmtree(os.path.join(cache_dir, entry), ignore_errors=True)


def _build_corpus(directory, src, files, texts, utf8, expected, progress, verbose, t0) -> dict:
    cache_dir, name = os.path.split(directory)
    vocab_size = expected["vocab_size"]
    is_valid = _held_out(files, expected["valid_fraction"])
    tmp = os.path.join(cache_dir, f".{name}.tmp-{os.getpid()}")
    os.makedirs(tmp)
    try:
        if verbose:
            print(
                f"k2-data: building the stdlib corpus from {len(files)} files in {src} "
                f"(byte-level BPE, vocab {vocab_size})",
                flush=True,
            )
        train_texts = [t for t, v in zip(texts, is_valid) if not v]
        tok = train_byte_level_bpe(train_texts, vocab_size, length=len(train_texts))
        # (encode_special_tokens is on: a literal "<|endoftext|>" in a source file is text, not a boundary)
        tok.save(os.path.join(tmp, "tokenizer.json"))
        dtype = token_dtype(tok.get_vocab_size(with_added_tokens=True))
        doc_files, tokens = _write_splits(tmp, tok, dtype, files, texts, is_valid, progress)
        manifest = _manifest(tmp, expected, src, tok, dtype, files, utf8, doc_files, tokens, t0)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")
        _swap_into_place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        print(f"k2-data: built {directory} in {time.time() - t0:.1f} s", flush=True)
    return manifest


def _held_out(files: list, valid_fraction: float) -> list:
    """Per file, whether it goes to the validation split (at least one file each way)."""
    is_valid = [_is_valid_doc(rel, valid_fraction) for rel in files]
    if not any(is_valid):  # tiny corpora: hold out the file with the smallest score
        is_valid[min(range(len(files)), key=lambda i: _valid_score(files[i]))] = True
    if all(is_valid):
        is_valid[max(range(len(files)), key=lambda i: _valid_score(files[i]))] = False
    return is_valid


def _write_splits(tmp, tok, dtype, files, texts, is_valid, progress) -> tuple:
    """Tokenize every document (EOD appended) into ``train`` / ``valid`` ``.bin``/``.idx`` under ``tmp``;
    returns (files per split in document order, tokens per split)."""
    from tqdm import tqdm

    eod = tok.token_to_id(EOD_TOKEN)
    writers = {s: IndexedDatasetWriter(os.path.join(tmp, s), dtype) for s in ("train", "valid")}
    doc_files = {"train": [], "valid": []}
    tokens = {"train": 0, "valid": 0}
    with tqdm(
        total=len(files),
        unit="doc",
        desc="k2-data: tokenize",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        for lo in range(0, len(files), _ENCODE_CHUNK):
            hi = min(lo + _ENCODE_CHUNK, len(files))
            for i, ids in zip(range(lo, hi), _encode_chunk(tok, texts[lo:hi])):
                split = "valid" if is_valid[i] else "train"
                arr = np.asarray(ids + [eod], dtype=dtype)
                writers[split].add_documents(arr, np.array([arr.size]))
                doc_files[split].append(files[i])
                tokens[split] += int(arr.size)
            bar.update(hi - lo)
            bar.set_postfix(tokens=f"{tokens['train'] + tokens['valid']:,}")
            moved()  # (for the hang watchdog: rank 0 builds the corpus while the others wait)
    for w in writers.values():
        w.finalize()
    return doc_files, tokens


def _manifest(tmp, expected, src, tok, dtype, files, utf8, doc_files, tokens, t0) -> dict:
    """The corpus's ``manifest.json``: the settings it was built with, the tokenizer, counts, outputs."""
    import tokenizers

    outputs = file_entries(tmp, ("tokenizer.json", "train.bin", "train.idx", "valid.bin", "valid.idx"))
    return {
        **expected,
        "corpus": "python-stdlib",
        "stdlib_dir": src,
        "tokenizer_vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eod_token": EOD_TOKEN,
        "eod_id": tok.token_to_id(EOD_TOKEN),
        "pad_token": PAD_TOKEN,
        "pad_id": tok.token_to_id(PAD_TOKEN),
        "token_dtype": np.dtype(dtype).name,
        "tokenizers_version": tokenizers.__version__,
        "file_count": len(files),
        "documents": {s: len(v) for s, v in doc_files.items()},
        "tokens": tokens,
        "non_utf8_files": [f for f, ok in zip(files, utf8) if not ok],
        "files": doc_files,  # in .bin document order
        "outputs": outputs,
        "build_seconds": round(time.time() - t0, 2),
    }


def _swap_into_place(tmp: str, directory: str) -> None:
    """Rename ``tmp`` to ``directory``; an old (mismatching) directory is moved aside first, then deleted."""
    cache_dir, name = os.path.split(directory)
    old = None
    if os.path.exists(directory):
        old = os.path.join(cache_dir, f".{name}.old-{os.getpid()}")
        os.rename(directory, old)
    os.rename(tmp, directory)
    if old:
        shutil.rmtree(old, ignore_errors=True)
