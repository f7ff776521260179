"""Data layer: the embedded stdlib corpus, data-setting validation, megatron GPT datasets, microbatches.

Pieces, in the order the trainer uses them:

* :func:`resolve_data` -- checks every ``data.*`` setting (prefix files, blend syntax, tokenizer, vocab
  size against ``model.vocab_size``) before any heavy work or process group; raises
  :class:`launcher.config.ConfigError` naming the setting.
* :func:`prepare_stdlib_corpus` -- builds (once; idempotent, crash-safe) the embedded default corpus:
  the interpreter's own standard-library ``*.py`` files, a byte-level BPE tokenizer trained on them and
  megatron indexed datasets (``train``/``valid`` ``.bin``/``.idx``). ``k2-data`` (:func:`cli`) runs it.
* :func:`build_datasets` -- megatron-core's ``BlendedMegatronDatasetBuilder`` + ``GPTDataset`` over the
  resolved blend(s): fixed-length samples of ``seq_length`` tokens (+1 for the shifted labels).
* :class:`MicrobatchIterator` -- the deterministic global batch -> DP rank -> microbatch order.

Units: sample = one sequence of ``seq_length`` tokens; batch sizes are in samples (sequences).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import platform
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from launcher.config import ConfigError
from launcher.tokenizer import EOD_TOKEN, PAD_TOKEN, HFTokenizer

__all__ = [
    "CorpusPaths",
    "HFTokenizer",
    "MicrobatchIterator",
    "ResolvedData",
    "build_datasets",
    "cli",
    "list_stdlib_files",
    "prepare_stdlib_corpus",
    "resolve_data",
    "stdlib_corpus_dir",
]

CORPUS_FORMAT = 1  # bump when the corpus layout or tokenization changes (forces a rebuild)
_ENCODE_CHUNK = 64  # documents per tokenizers.encode_batch call (parallel inside tokenizers)
_MIN_VOCAB = 256 + 2  # byte alphabet + <|endoftext|> + <|pad|>
_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


# ----------------------------------------------------------------------------------------------------
# The embedded stdlib corpus
# ----------------------------------------------------------------------------------------------------


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


def list_stdlib_files(stdlib_dir: Optional[str] = None) -> list[str]:
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


def stdlib_corpus_dir(data_cfg: Any) -> str:
    """Absolute ``<data.cache_dir>/stdlib-<python version>-v<data.vocab_size>`` (may not exist yet)."""
    cache_dir = os.path.abspath(os.path.expanduser(str(data_cfg.cache_dir)))
    return os.path.join(cache_dir, f"stdlib-{_python_version()}-v{int(data_cfg.vocab_size)}")


def _check_embedded_settings(data_cfg: Any) -> None:
    vocab = data_cfg.vocab_size
    if not isinstance(vocab, int) or vocab < _MIN_VOCAB:
        raise ConfigError(
            f"data.vocab_size={vocab} is too small for the byte-level BPE tokenizer of the embedded "
            f"corpus: it needs at least {_MIN_VOCAB} (256 bytes + {EOD_TOKEN} + {PAD_TOKEN})"
        )
    vf = data_cfg.valid_fraction
    if not isinstance(vf, (int, float)) or not (0.0 < float(vf) < 1.0):
        raise ConfigError(
            f"data.valid_fraction={vf} must be in (0, 1): the share of stdlib files held out for "
            f"validation (e.g. 0.02)"
        )


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


def _read_matching_manifest(directory: str, expected: dict) -> Optional[dict]:
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
        if not os.path.isfile(p) or os.path.getsize(p) != meta.get("bytes"):
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


@contextlib.contextmanager
def _file_lock(path: str):
    """Exclusive advisory lock (``flock``); released by the kernel if the process dies."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _train_tokenizer(texts: Sequence[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _encode_chunk(tok, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of a chunk of documents (no EOD). Separate function so tests can inject a crash."""
    return [e.ids for e in tok.encode_batch(list(texts), add_special_tokens=False)]


def prepare_stdlib_corpus(
    data_cfg: Any, *, progress: bool = True, verbose: bool = True, stdlib_dir: Optional[str] = None
) -> CorpusPaths:
    """Build the embedded stdlib corpus into ``<data.cache_dir>/stdlib-<pyver>-v<vocab>/`` (or reuse it).

    Every ``*.py`` file of the running interpreter's standard library (sorted, ``site-packages``
    skipped) is one document: its text (UTF-8; latin-1 for the few files that are not UTF-8) encoded
    with a byte-level BPE tokenizer of ``data.vocab_size`` ids (special tokens ``<|endoftext|>`` = EOD,
    ``<|pad|>``) trained on the training files, followed by one EOD token. Files go to the validation
    split by a hash of their relative path (about ``data.valid_fraction`` of them, at least one).

    Output: ``tokenizer.json``, ``train.bin/.idx``, ``valid.bin/.idx`` (written by megatron-core's
    ``IndexedDatasetBuilder``; token dtype uint16 below 65,500 ids) and ``manifest.json``. The
    directory is built under a temporary name and renamed into place last, so an interrupted build
    never leaves a complete-looking directory; the next build removes the leftovers. Builds are
    serialised with a file lock, so concurrent callers (e.g. several ranks) build once.

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
    _check_embedded_settings(data_cfg)
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
        with _file_lock(os.path.join(cache_dir, f".{name}.lock")):
            manifest = _read_matching_manifest(directory, expected)  # another process built it
            if manifest is None:
                _remove_leftovers(cache_dir, name)
                manifest = _build_corpus(
                    directory, src, files, texts, utf8, expected, progress, verbose, t0
                )
                return _paths(directory, manifest, rebuilt=True)
    if verbose:
        print(
            f"k2-data: stdlib corpus is up to date at {directory} (manifest matches); skipped "
            f"rebuilding",
            flush=True,
        )
    return _paths(directory, manifest, rebuilt=False)


def _remove_leftovers(cache_dir: str, name: str) -> None:
    """Temp/old directories of earlier builds that died (only called while holding the build lock)."""
    for entry in os.listdir(cache_dir):
        if entry.startswith((f".{name}.tmp-", f".{name}.old-")):
            shutil.rmtree(os.path.join(cache_dir, entry), ignore_errors=True)


def _build_corpus(directory, src, files, texts, utf8, expected, progress, verbose, t0) -> dict:
    from tqdm import tqdm

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    cache_dir, name = os.path.split(directory)
    vocab_size = expected["vocab_size"]
    is_valid = [_is_valid_doc(rel, expected["valid_fraction"]) for rel in files]
    if not any(is_valid):  # tiny corpora: hold out the file with the smallest score
        is_valid[min(range(len(files)), key=lambda i: _valid_score(files[i]))] = True
    if all(is_valid):
        is_valid[max(range(len(files)), key=lambda i: _valid_score(files[i]))] = False

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
        tok = _train_tokenizer(train_texts, vocab_size)
        # a literal "<|endoftext|>" inside a source file is text, not a document boundary
        tok.encode_special_tokens = True
        tok_path = os.path.join(tmp, "tokenizer.json")
        tok.save(tok_path)
        eod = tok.token_to_id(EOD_TOKEN)
        pad = tok.token_to_id(PAD_TOKEN)
        dtype = DType.optimal_dtype(tok.get_vocab_size(with_added_tokens=True))

        builders = {
            s: IndexedDatasetBuilder(os.path.join(tmp, f"{s}.bin"), dtype=dtype)
            for s in ("train", "valid")
        }
        doc_files = {"train": [], "valid": []}
        tokens = {"train": 0, "valid": 0}
        with tqdm(
            total=len(files), unit="doc", desc="k2-data: tokenize", disable=not progress,
            file=sys.stderr, dynamic_ncols=True,
        ) as bar:
            for lo in range(0, len(files), _ENCODE_CHUNK):
                hi = min(lo + _ENCODE_CHUNK, len(files))
                for i, ids in zip(range(lo, hi), _encode_chunk(tok, texts[lo:hi])):
                    split = "valid" if is_valid[i] else "train"
                    arr = np.asarray(ids + [eod], dtype=dtype)
                    builders[split].add_document(arr, [arr.size])
                    doc_files[split].append(files[i])
                    tokens[split] += int(arr.size)
                bar.update(hi - lo)
                bar.set_postfix(tokens=f"{tokens['train'] + tokens['valid']:,}")
        for s, b in builders.items():
            b.finalize(os.path.join(tmp, f"{s}.idx"))

        import tokenizers

        outputs = {
            n: {"bytes": os.path.getsize(os.path.join(tmp, n))}
            for n in ("tokenizer.json", "train.bin", "train.idx", "valid.bin", "valid.idx")
        }
        manifest = {
            **expected,
            "corpus": "python-stdlib",
            "stdlib_dir": src,
            "tokenizer_vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "eod_token": EOD_TOKEN,
            "eod_id": eod,
            "pad_token": PAD_TOKEN,
            "pad_id": pad,
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
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.write("\n")

        # swap into place: an old (mismatching) directory is moved aside first, then deleted
        old = None
        if os.path.exists(directory):
            old = os.path.join(cache_dir, f".{name}.old-{os.getpid()}")
            os.rename(directory, old)
        os.rename(tmp, directory)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        print(f"k2-data: built {directory} in {time.time() - t0:.1f} s", flush=True)
    return manifest


# ----------------------------------------------------------------------------------------------------
# Validation of the data settings
# ----------------------------------------------------------------------------------------------------

Blend = tuple[list[str], Optional[list[float]]]  # megatron's (prefixes, weights or None)


@dataclass
class ResolvedData:
    """Validated data settings, ready for :func:`build_datasets`.

    Attributes:
        train_blend: ``(prefixes, weights)`` in megatron's blend form; ``weights`` None = in
            proportion to dataset size.
        valid_blend: the same for ``data.valid_path`` (or the embedded valid split); None when the
            validation data is carved out of ``train_blend`` by ``split``.
        split: megatron split string ``"train,valid,test"`` used when ``valid_blend`` is None.
        tokenizer_path: absolute path of the ``tokenizer.json``.
        tokenizer_vocab_size: ids of that tokenizer (<= ``model.vocab_size``).
        index_cache_dir: ``<data.cache_dir>/index_cache``: megatron's cached sample/shuffle indices.
        embedded: True for the stdlib corpus (``data.path=null``), which
            :func:`prepare_stdlib_corpus` must have built before :func:`build_datasets`.
        stats: per prefix, ``(documents, tokens)`` read from its ``.idx`` (user data only).
    """

    train_blend: Blend
    valid_blend: Optional[Blend]
    split: Optional[str]
    tokenizer_path: str
    tokenizer_vocab_size: int
    index_cache_dir: str
    embedded: bool = False
    stats: dict = field(default_factory=dict)


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _is_number(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    return isinstance(x, str) and bool(_NUMBER_RE.match(x.strip()))


def _norm_prefix(p: str) -> str:
    p = os.path.expanduser(p.strip())
    for suffix in (".bin", ".idx"):
        if p.endswith(suffix):
            p = p[: -len(suffix)]
    return os.path.abspath(p)


def parse_blend(value: Any, key: str) -> Blend:
    """Parse one prefix, a list of prefixes or a blend ``[w1, prefix1, w2, prefix2, ...]``.

    Args:
        value: the setting's value (str, list, or an OmegaConf ListConfig).
        key: the setting's name, for messages (``data.path`` / ``data.valid_path``).

    Returns:
        ``(absolute prefixes, weights or None)``; a trailing ``.bin``/``.idx`` on a prefix is dropped.

    Raises:
        ConfigError: empty list, odd-length blend, non-numeric / negative / zero / non-finite weight,
            a number where a prefix belongs, or a value that is neither a string nor a list.
    """
    value = _plain(value)
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{key} is an empty string; give a dataset prefix (PREFIX.bin/PREFIX.idx)")
        return [_norm_prefix(value)], None
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"{key}={value!r} must be a dataset prefix, a list of prefixes or a blend "
            f"[weight1, prefix1, weight2, prefix2, ...]"
        )
    items = list(value)
    if not items:
        raise ConfigError(f"{key} is an empty list; give at least one dataset prefix")
    numeric = [_is_number(x) for x in items]
    if not any(numeric):
        bad = [x for x in items if not isinstance(x, str) or not x.strip()]
        if bad:
            raise ConfigError(f"{key}: every prefix must be a non-empty string, got {bad[0]!r}")
        return [_norm_prefix(x) for x in items], None
    # a weighted blend
    form = "a blend is [weight1, prefix1, weight2, prefix2, ...]"
    if len(items) % 2:
        raise ConfigError(
            f"{key} has {len(items)} entries but {form} (an even number of entries): {items}"
        )
    prefixes, weights = [], []
    for i in range(0, len(items), 2):
        w, p = items[i], items[i + 1]
        if not _is_number(w):
            raise ConfigError(
                f"{key}: weight at position {i} is {w!r}, which is not a number; {form}: {items}"
            )
        if _is_number(p) or not isinstance(p, str) or not p.strip():
            raise ConfigError(
                f"{key}: expected a dataset prefix at position {i + 1}, got {p!r}; {form}: {items}"
            )
        wf = float(w)
        if not math.isfinite(wf) or wf < 0:
            raise ConfigError(f"{key}: weight {w!r} of '{p}' is negative or not finite; weights must be > 0")
        if wf == 0:
            raise ConfigError(f"{key}: weight of '{p}' is 0; remove the entry instead (weights must be > 0)")
        prefixes.append(_norm_prefix(p))
        weights.append(wf)
    return prefixes, weights


def _read_idx_lengths(idx_path: str) -> tuple[np.ndarray, int]:
    """Sequence lengths (int32) and token dtype itemsize from a megatron ``.idx`` (format version 1)."""
    import struct

    with open(idx_path, "rb") as f:
        header = f.read(34)
    if len(header) < 34 or header[:9] != b"MMIDIDX\x00\x00":
        raise ValueError("not a megatron indexed-dataset index (bad header)")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != 1:
        raise ValueError(f"unsupported .idx version {version}")
    code = header[17]
    itemsize = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}.get(code)
    if itemsize is None:
        raise ValueError(f"unknown token dtype code {code}")
    (count,) = struct.unpack("<Q", header[18:26])
    lengths = np.fromfile(idx_path, dtype=np.int32, count=count, offset=34)
    if lengths.size != count:
        raise ValueError("truncated .idx")
    return lengths, itemsize


def _check_prefixes(blend: Blend, key: str, stats: dict) -> None:
    for p in blend[0]:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(p + ext):
                raise ConfigError(
                    f"{key}: dataset prefix '{p}' is incomplete: missing file {p + ext} (a megatron "
                    f"indexed dataset is PREFIX.bin + PREFIX.idx, e.g. written by k2-data or "
                    f"megatron's tools/preprocess_data.py)"
                )
        if p in stats:
            continue
        try:
            lengths, itemsize = _read_idx_lengths(p + ".idx")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}: cannot read {p}.idx: {e}") from None
        tokens = int(lengths.sum(dtype=np.int64))
        if lengths.size == 0 or tokens == 0:
            raise ConfigError(f"{key}: dataset '{p}' holds no tokens")
        bin_bytes = os.path.getsize(p + ".bin")
        if bin_bytes != tokens * itemsize:
            raise ConfigError(
                f"{key}: {p}.bin has {bin_bytes} bytes but {p}.idx describes {tokens} tokens of "
                f"{itemsize} bytes ({tokens * itemsize} bytes); the pair is truncated or mismatched"
            )
        stats[p] = (int(lengths.size), tokens)


def _parse_split(split: Any) -> list[float]:
    s = str(split)
    parts = [x.strip() for x in re.split(r"[,/]", s)]
    if not 1 <= len(parts) <= 3 or not all(_NUMBER_RE.match(x) for x in parts):
        raise ConfigError(
            f"data.split={s!r} must be 1 to 3 non-negative numbers 'train,valid,test' "
            f"(e.g. '98,2,0'; quote it on the command line: data.split='98,2,0')"
        )
    v = [float(x) for x in parts] + [0.0] * (3 - len(parts))
    if v[0] <= 0:
        raise ConfigError(f"data.split={s!r} gives the training split no share (first number must be > 0)")
    return v


def resolve_data(cfg: Any) -> ResolvedData:
    """Validate the ``data`` settings against each other and ``model.vocab_size``; no heavy work.

    ``data.path`` null selects the embedded stdlib corpus (``data.vocab_size``, ``data.valid_fraction``,
    built by :func:`prepare_stdlib_corpus`; ``data.tokenizer`` / ``data.valid_path`` must then be null).
    Otherwise ``data.path`` is one prefix, a list of prefixes or a blend ``[w1, prefix1, w2, ...]``;
    ``data.valid_path`` the same or null (then ``data.split`` carves validation out of the train
    blend); ``data.tokenizer`` the ``tokenizer.json`` that produced the token ids.

    Checks: blend syntax; both ``PREFIX.bin`` and ``PREFIX.idx`` exist, the ``.idx`` is readable and
    the ``.bin`` size agrees with it; ``data.split`` parses and leaves every used split documents; the
    tokenizer exists, loads and has an EOD token; its vocab size <= ``model.vocab_size``.

    Args:
        cfg: the full config (``load_config`` result); ``cfg.data`` and ``cfg.model.vocab_size`` are read.

    Returns:
        :class:`ResolvedData`.

    Raises:
        ConfigError: one message naming the offending setting (and the missing file, or both vocab
            sizes and what to set).
    """
    data = cfg.data
    model_vocab = int(cfg.model.vocab_size)
    cache_dir = os.path.abspath(os.path.expanduser(str(data.cache_dir)))
    index_cache_dir = os.path.join(cache_dir, "index_cache")

    if data.path is None:
        if data.valid_path is not None:
            raise ConfigError(
                "data.valid_path is set but data.path is null (the embedded stdlib corpus has its own "
                "validation split); set data.path too, or data.valid_path=null"
            )
        if data.tokenizer is not None:
            raise ConfigError(
                f"data.tokenizer={data.tokenizer} is set but data.path is null: the embedded stdlib "
                f"corpus uses the tokenizer k2-data trains; set data.tokenizer=null or give data.path"
            )
        _check_embedded_settings(data)
        if int(data.vocab_size) > model_vocab:
            raise ConfigError(
                f"data.vocab_size={data.vocab_size} (the embedded corpus tokenizer) exceeds "
                f"model.vocab_size={model_vocab}: token ids would overflow the embedding table; set "
                f"model.vocab_size={data.vocab_size} (or larger) or data.vocab_size<={model_vocab}"
            )
        d = stdlib_corpus_dir(data)
        return ResolvedData(
            train_blend=([os.path.join(d, "train")], None),
            valid_blend=([os.path.join(d, "valid")], None),
            split=None,
            tokenizer_path=os.path.join(d, "tokenizer.json"),
            tokenizer_vocab_size=int(data.vocab_size),
            index_cache_dir=index_cache_dir,
            embedded=True,
        )

    stats: dict = {}
    train_blend = parse_blend(data.path, "data.path")
    valid_blend = None if data.valid_path is None else parse_blend(data.valid_path, "data.valid_path")
    _check_prefixes(train_blend, "data.path", stats)
    if valid_blend is not None:
        _check_prefixes(valid_blend, "data.valid_path", stats)
        split = None
    else:
        vec = _parse_split(data.split)
        split = ",".join(f"{x:g}" for x in vec)
        total = sum(vec)
        beg, end = vec[0] / total, (vec[0] + vec[1]) / total
        for p in train_blend[0]:  # megatron slices each prefix's documents by the split bookends
            n = stats[p][0]
            if int(round(beg * n)) == 0:
                raise ConfigError(
                    f"data.split={data.split!r} leaves no training documents in '{p}' ({n} documents)"
                )
            if vec[1] > 0 and int(round(end * n)) - int(round(beg * n)) == 0:
                raise ConfigError(
                    f"data.split={data.split!r} leaves no validation documents in '{p}' ({n} "
                    f"documents); raise the valid share or give data.valid_path"
                )

    if data.tokenizer is None:
        raise ConfigError(
            "data.tokenizer is null but data.path is set: give the tokenizer.json that produced the "
            "token ids of data.path (data.tokenizer=/path/to/tokenizer.json)"
        )
    tok_path = os.path.abspath(os.path.expanduser(str(data.tokenizer)))
    if not os.path.isfile(tok_path):
        raise ConfigError(f"data.tokenizer: file not found: {tok_path}")
    try:
        tok = HFTokenizer(tok_path)
    except ValueError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    if tok.vocab_size > model_vocab:
        raise ConfigError(
            f"data.tokenizer {tok_path} has {tok.vocab_size} ids but model.vocab_size={model_vocab}: "
            f"token ids would overflow the embedding table; set model.vocab_size={tok.vocab_size} "
            f"(or larger)"
        )
    return ResolvedData(
        train_blend=train_blend,
        valid_blend=valid_blend,
        split=split,
        tokenizer_path=tok_path,
        tokenizer_vocab_size=tok.vocab_size,
        index_cache_dir=index_cache_dir,
        embedded=False,
        stats=stats,
    )


# ----------------------------------------------------------------------------------------------------
# megatron GPT datasets
# ----------------------------------------------------------------------------------------------------


def build_datasets(
    resolved: ResolvedData,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: Optional[int],
    *,
    create_attention_mask: bool = False,
):
    """Build the train and validation ``GPTDataset``\\ s (or ``BlendedDataset``\\ s of them).

    Uses megatron-core's ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` with ``GPTDatasetConfig``:
    ``blend``+``split`` when the validation data is carved from the train blend, else
    ``blend_per_split``; ``reset_position_ids`` / ``reset_attention_mask`` / ``eod_mask_loss`` False;
    ``mmap_bin_files`` True; sample/shuffle indices cached in ``resolved.index_cache_dir`` (keyed by
    an MD5 of prefixes, sizes, seed, seq_length, split and tokenizer, so runs share them safely).

    Each sample is a dict of ``tokens`` / ``labels`` (int64 ``[seq_length]``; labels = tokens shifted
    left by one), ``loss_mask`` (float32 ``[seq_length]``), ``position_ids`` (int64 ``[seq_length]``),
    ``attention_mask`` (bool ``[1, seq_length, seq_length]``, True = masked) only if
    ``create_attention_mask``, and ``dataset_id`` when the split is a blend of several prefixes.

    Distributed: works without ``torch.distributed``. When it IS initialised, megatron builds on global
    rank 0 first and the other ranks load its cached indices after a ``barrier()`` on the default
    group, so this function is then a collective: every rank of the world must call it, with the same
    arguments, and ``index_cache_dir`` must be on a filesystem all ranks see.

    Args:
        resolved: from :func:`resolve_data`.
        seq_length: tokens per sample.
        seed: megatron's ``random_seed`` for the document / sample shuffles.
        train_samples: at least this many training samples are indexed (repeating epochs as needed).
        valid_samples: the same for validation; None = one pass (unweighted validation blends only).
        create_attention_mask: also return megatron's dense causal mask per sample (memory: S^2).

    Returns:
        ``(train_ds, valid_ds)``; ``valid_ds`` is None when ``data.split`` gives validation no share.

    Raises:
        FileNotFoundError: the embedded corpus has not been prepared (run ``k2-data``).
        ConfigError: a split holds fewer than ``seq_length + 1`` tokens, so it yields no sample.
        ValueError: non-positive ``seq_length`` / ``train_samples``, or ``valid_samples`` None with a
            weighted validation blend (megatron needs a size to honour weights).
    """
    import torch

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if int(seq_length) <= 0 or int(train_samples) <= 0:
        raise ValueError(f"seq_length ({seq_length}) and train_samples ({train_samples}) must be > 0")
    if resolved.embedded:
        for f in [resolved.tokenizer_path] + [
            p + ext for p in resolved.train_blend[0] + resolved.valid_blend[0] for ext in (".bin", ".idx")
        ]:
            if not os.path.isfile(f):
                raise FileNotFoundError(
                    f"the embedded stdlib corpus is not prepared ({f} is missing): run k2-data with the "
                    f"same data.* settings, or call launcher.data.prepare_stdlib_corpus first"
                )
    valid_weighted = (resolved.valid_blend or resolved.train_blend)[1] is not None
    if valid_samples is None and valid_weighted:
        raise ValueError("valid_samples=None (one pass) needs an unweighted validation blend")

    tokenizer = HFTokenizer(resolved.tokenizer_path)
    common = dict(
        random_seed=int(seed),
        sequence_length=int(seq_length),
        path_to_cache=resolved.index_cache_dir,
        mmap_bin_files=True,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
    )
    if resolved.valid_blend is not None:
        config = GPTDatasetConfig(
            blend_per_split=[resolved.train_blend, resolved.valid_blend, None], **common
        )
    else:
        config = GPTDatasetConfig(blend=resolved.train_blend, split=resolved.split, **common)
        # never build the test split (the builder would otherwise index it with size 0)
        config.split_matrix = [config.split_matrix[0], config.split_matrix[1], None]
    sizes = [int(train_samples), None if valid_samples is None else int(valid_samples), 0]

    os.makedirs(resolved.index_cache_dir, exist_ok=True)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        train_ds, valid_ds, _ = builder.build()  # rank 0 first, barrier, then the rest
    else:  # independent processes (e.g. two runs) must not write the same cache files at once
        with _file_lock(os.path.join(resolved.index_cache_dir, ".build.lock")):
            train_ds, valid_ds, _ = builder.build()

    where = "data.path" if not resolved.embedded else "the embedded corpus"
    if train_ds is None or len(train_ds) == 0:
        raise ConfigError(f"{where} yields no training sample of seq_length={seq_length} tokens "
                          "(the schedule phase's context length)")
    if valid_ds is not None and len(valid_ds) == 0:
        setting = (
            "data.valid_path" if resolved.valid_blend is not None and not resolved.embedded
            else "data.valid_fraction" if resolved.embedded else "data.split"
        )
        raise ConfigError(
            f"the validation data ({setting}) holds fewer than seq_length+1={seq_length + 1} "
            f"tokens, so it yields no validation sample; lower the schedule phase's seq_length or "
            f"enlarge {setting}"
        )
    return train_ds, valid_ds


# ----------------------------------------------------------------------------------------------------
# Microbatches
# ----------------------------------------------------------------------------------------------------


def _collate(samples: Sequence[dict]) -> dict:
    import torch

    out = {}
    for key, first in samples[0].items():
        if first is None:
            continue
        if isinstance(first, torch.Tensor):
            out[key] = torch.stack([s[key] for s in samples])
        elif isinstance(first, np.ndarray):
            out[key] = torch.from_numpy(np.stack([s[key] for s in samples]))
        else:
            out[key] = torch.tensor([s[key] for s in samples])
    return out


class MicrobatchIterator:
    """Deterministic, infinite iterator over this DP rank's microbatches.

    Global batch ``i`` holds dataset samples ``[start + i*GBS, start + (i+1)*GBS)`` (sample numbers
    taken modulo ``len(dataset)``; ``epoch`` counts the wraps). It is cut into ``dp_size`` contiguous
    blocks of ``GBS / dp_size`` samples -- DP rank ``r`` gets block ``r`` -- and each block into
    ``num_microbatches = GBS / (micro_batch_size * dp_size)`` microbatches of ``micro_batch_size``
    samples, yielded in order. The union over DP ranks of one step's microbatches is exactly the
    global batch, for any ``dp_size``. Creating one is O(1) (no prefetch), so a pipeline schedule can
    hold one per model chunk over the same sequence.

    Each microbatch is the dataset's sample dict with every entry stacked on a new leading dim:
    ``tokens``/``labels``/``position_ids`` int64 ``[micro_batch_size, seq_length]``, ``loss_mask``
    float32 ``[micro_batch_size, seq_length]`` (plus whatever else the samples carry).

    Args:
        dataset: indexable, ``len()``-able; items are dicts of tensors (a megatron GPT dataset).
        global_batch_size: samples per optimizer step over all DP ranks (GBS).
        micro_batch_size: samples per forward/backward on one rank.
        dp_rank, dp_size: this rank's data-parallel index and the DP world size.
        start_sample: global sample number of the first global batch (``consumed_samples`` of a
            checkpoint to resume from).

    Attributes:
        num_microbatches: microbatches per global batch on each DP rank.
        consumed_samples: global samples of completed global batches (``start_sample`` + GBS per
            global batch whose last microbatch this iterator has yielded): what to checkpoint.

    Raises:
        ConfigError: GBS not divisible by ``micro_batch_size * dp_size``, or an empty dataset.
        ValueError: non-positive sizes, ``dp_rank`` outside ``[0, dp_size)``, negative start.
    """

    def __init__(
        self,
        dataset: Any,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        start_sample: int = 0,
    ) -> None:
        gbs, mbs, dp = int(global_batch_size), int(micro_batch_size), int(dp_size)
        if gbs <= 0 or mbs <= 0 or dp <= 0:
            raise ValueError(
                f"train.global_batch_size ({gbs}), train.micro_batch_size ({mbs}) and the DP size "
                f"({dp}) must be > 0"
            )
        if gbs % (mbs * dp):
            raise ConfigError(
                f"train.global_batch_size={gbs} is not divisible by train.micro_batch_size={mbs} x "
                f"DP size {dp} = {mbs * dp}; make train.global_batch_size a multiple of {mbs * dp} "
                f"(e.g. {max(1, round(gbs / (mbs * dp))) * mbs * dp}) or change train.micro_batch_size"
            )
        if not 0 <= int(dp_rank) < dp:
            raise ValueError(f"dp_rank={dp_rank} outside [0, {dp})")
        if int(start_sample) < 0:
            raise ValueError(f"start_sample={start_sample} must be >= 0")
        self.dataset = dataset
        self.dataset_len = len(dataset)
        if self.dataset_len == 0:
            raise ConfigError("the dataset has no samples (seq_length longer than the data?)")
        self.global_batch_size = gbs
        self.micro_batch_size = mbs
        self.dp_rank = int(dp_rank)
        self.dp_size = dp
        self.local_batch_size = gbs // dp
        self.num_microbatches = gbs // (mbs * dp)
        self.start_sample = int(start_sample)
        self._batch_start = self.start_sample  # first global sample of the current global batch
        self._next_mb = 0  # next microbatch within the current global batch

    @property
    def consumed_samples(self) -> int:
        """Global samples of fully yielded global batches (resume point)."""
        return self._batch_start

    @property
    def global_batches_done(self) -> int:
        """Global batches fully yielded by this iterator."""
        return (self._batch_start - self.start_sample) // self.global_batch_size

    @property
    def epoch(self) -> int:
        """Passes over the dataset completed before the next sample (0 in the first pass)."""
        return self._next_sample() // self.dataset_len

    def _next_sample(self) -> int:
        return (
            self._batch_start
            + self.dp_rank * self.local_batch_size
            + self._next_mb * self.micro_batch_size
        )

    def sample_numbers(self, global_batch: int, microbatch: int) -> list[int]:
        """Global (unwrapped) sample numbers of microbatch ``microbatch`` of global batch ``global_batch``
        (counted from ``start_sample``) on this DP rank; dataset index = number % ``len(dataset)``."""
        if not 0 <= microbatch < self.num_microbatches:
            raise IndexError(f"microbatch {microbatch} outside [0, {self.num_microbatches})")
        first = (
            self.start_sample
            + global_batch * self.global_batch_size
            + self.dp_rank * self.local_batch_size
            + microbatch * self.micro_batch_size
        )
        return list(range(first, first + self.micro_batch_size))

    def get(self, global_batch: int, microbatch: int) -> dict:
        """Microbatch ``microbatch`` of global batch ``global_batch`` (random access; no state change)."""
        nums = self.sample_numbers(global_batch, microbatch)
        return _collate([self.dataset[n % self.dataset_len] for n in nums])

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        batch = self.get(self.global_batches_done, self._next_mb)
        self._next_mb += 1
        if self._next_mb == self.num_microbatches:
            self._next_mb = 0
            self._batch_start += self.global_batch_size
        return batch


# ----------------------------------------------------------------------------------------------------
# k2-data
# ----------------------------------------------------------------------------------------------------

_USAGE = """usage: k2-data [HYDRA_OVERRIDE ...]

Prepare the embedded default corpus (data.path=null): the Python standard library's own *.py files,
a byte-level BPE tokenizer (data.vocab_size) and megatron .bin/.idx train/valid splits, written to
<data.cache_dir>/stdlib-<pyver>-v<vocab>/. Idempotent. With data.path set, validate the user data
(data.path, data.valid_path, data.tokenizer, data.split) and print its size instead.

examples:
  k2-data
  k2-data data.vocab_size=8192 model.vocab_size=8192 data.cache_dir=/scratch/k2
  k2-data data.path=/data/web_text_document data.tokenizer=/data/tokenizer.json
"""


def cli(argv: Optional[Sequence[str]] = None) -> None:
    """``k2-data`` entry point: Hydra overrides in, corpus summary out. Exit status 2 on a bad setting."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(_USAGE, end="")
        return
    import warnings

    from launcher.config import load_config

    # megatron-core's import-time notices (no TE/Apex on CPU, deprecations) are noise for this tool
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\..*")
    try:
        cfg = load_config(argv)
        resolved = resolve_data(cfg)
        if resolved.embedded:
            paths = prepare_stdlib_corpus(cfg.data)
            m = paths.manifest
            print(
                f"k2-data: Python {m['python_version']} stdlib, {m['file_count']} files "
                f"({len(m['non_utf8_files'])} not UTF-8, read as latin-1) -> {paths.directory}"
            )
            for s in ("train", "valid"):
                print(
                    f"  {s:5s}: {m['documents'][s]:6,d} documents {m['tokens'][s]:12,d} tokens  "
                    f"{getattr(paths, s + '_prefix')}.bin/.idx"
                )
            print(
                f"  tokenizer: {paths.tokenizer_path} (byte-level BPE, {m['tokenizer_vocab_size']} ids, "
                f"eod={m['eod_id']} pad={m['pad_id']})"
            )
            if paths.rebuilt:
                print(f"  built in {m['build_seconds']:.1f} s")
            else:
                print("  already up to date: nothing rebuilt")
        else:
            for key, blend in (("data.path", resolved.train_blend), ("data.valid_path", resolved.valid_blend)):
                if blend is None:
                    continue
                for i, p in enumerate(blend[0]):
                    docs, toks = resolved.stats[p]
                    w = "" if blend[1] is None else f" weight {blend[1][i]:g}"
                    print(f"k2-data: {key}: {p}{w}: {docs:,d} documents, {toks:,d} tokens")
            if resolved.valid_blend is None:
                print(f"k2-data: validation carved from data.path by data.split={resolved.split}")
            print(f"k2-data: tokenizer {resolved.tokenizer_path} ({resolved.tokenizer_vocab_size} ids): OK")
    except ConfigError as e:
        print(f"k2-data: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
