"""Validation of the ``data`` settings against the files on disk, before any heavy work or process group.

:func:`resolve_data` checks the blend syntax of ``data.path`` / ``data.valid_path`` (one prefix, a list, or
``[w1, prefix1, w2, prefix2, ...]``), that every ``PREFIX.bin`` / ``PREFIX.idx`` pair exists and agrees,
``data.split``, the tokenizer and its vocabulary against ``model.vocab_size``; it returns
:class:`ResolvedData` for :func:`k2.launcher.datasets.gpt.build_datasets`. The embedded corpus's settings
alone are checked by :func:`k2.config.validate.check_data`. Errors are :class:`ConfigError` naming the
setting (and the missing file).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from k2.config.errors import ConfigError
from k2.launcher.datasets.corpus import stdlib_corpus_dir
from k2.launcher.datasets.idx_format import DTYPE_OF_CODE, HEADER_BYTES, INDEX_HEADER, VERSION
from k2.launcher.datasets.preprocess import build_manifest, unfinished_build
from k2.launcher.datasets.tokenizer import load_user_tokenizer
from k2.launcher.datasets.verify import is_manifest_path, manifest_datasets

if TYPE_CHECKING:
    from k2.config.schema import K2Config

_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


Blend = tuple[list[str], list[float] | None]  # megatron's (prefixes, weights or None)

#: ``.bin`` files up to this size are scanned for token ids outside the tokenizer's vocabulary when the
#: settings are checked (numpy over a memory map: ~2 GB/s from the page cache, so at most ~1 s per file;
#: the embedded corpus's 18 MB train split takes ~9 ms). Larger files are not scanned.
TOKEN_SCAN_MAX_BYTES = 2 * 2**30
_SCAN_CHUNK = 2**26  # tokens per numpy pass (bounded memory for the comparisons)


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
        tokenizer_vocab_size: ids of that tokenizer (<= ``k2.model.vocab_size``).
        index_cache_dir: ``<data.cache_dir>/index_cache``: megatron's cached sample/shuffle indices.
        embedded: True for the stdlib corpus (``data.path=null``), which
            :func:`prepare_stdlib_corpus` must have built before :func:`build_datasets`.
        stats: per prefix, ``(documents, tokens)`` read from its ``.idx`` (user data only).
    """

    train_blend: Blend
    valid_blend: Blend | None
    split: str | None
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
        raise ConfigError(f"{key} has {len(items)} entries but {form} (an even number of entries): {items}")
    prefixes, weights = [], []
    for i in range(0, len(items), 2):
        w, p = items[i], items[i + 1]
        if not _is_number(w):
            raise ConfigError(f"{key}: weight at position {i} is {w!r}, which is not a number; {form}: {items}")
        if _is_number(p) or not isinstance(p, str) or not p.strip():
            raise ConfigError(f"{key}: expected a dataset prefix at position {i + 1}, got {p!r}; {form}: {items}")
        wf = float(w)
        if not math.isfinite(wf) or wf < 0:
            raise ConfigError(f"{key}: weight {w!r} of '{p}' is negative or not finite; weights must be > 0")
        if wf == 0:
            raise ConfigError(f"{key}: weight of '{p}' is 0; remove the entry instead (weights must be > 0)")
        prefixes.append(_norm_prefix(p))
        weights.append(wf)
    return prefixes, weights


def expand_manifests(blend: Blend, key: str, named: list) -> Blend:
    """``blend`` with every k2-data manifest entry (``PREFIX.manifest.json``: ``data.path`` of an array
    build) replaced by the datasets it lists, in its order; in a weighted blend the manifest's weight is
    shared by its datasets in proportion to their tokens. The tokenizers the manifests name are appended
    to ``named``.

    Raises:
        ConfigError: a manifest that is missing or unreadable, naming it and the setting.
    """
    prefixes, weights = blend
    if not any(is_manifest_path(p) for p in prefixes):
        return blend
    out_p, out_w = [], []
    for i, p in enumerate(prefixes):
        if not is_manifest_path(p):
            out_p.append(p)
            out_w.append(None if weights is None else weights[i])
            continue
        try:
            sets, tokens, tokenizer = manifest_datasets(p)
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
        if tokenizer is not None:
            named.append(tokenizer)
        out_p += sets
        total = sum(tokens) or 1
        out_w += [None if weights is None else weights[i] * t / total for t in tokens]
    return out_p, (None if weights is None else out_w)


def _read_idx_header(idx_path: str) -> tuple[np.ndarray, type]:
    """Sequence lengths (int32) and the token dtype from a megatron ``.idx`` (format version 1).

    Raises:
        ValueError: not a version-1 megatron ``.idx``, an unknown dtype code, or a truncated file.
    """
    import struct

    n = len(INDEX_HEADER)
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES or header[:n] != INDEX_HEADER:
        raise ValueError("not a megatron indexed-dataset index (bad header)")
    (version,) = struct.unpack("<Q", header[n : n + 8])
    if version != VERSION:
        raise ValueError(f"unsupported .idx version {version}")
    code = header[n + 8]
    dtype = DTYPE_OF_CODE.get(code)
    if dtype is None:
        raise ValueError(f"unknown token dtype code {code}")
    (count,) = struct.unpack("<Q", header[n + 9 : n + 17])
    (doc_indices,) = struct.unpack("<Q", header[n + 17 : n + 25])
    # sequence lengths int32, sequence offsets int64, document indices int64 (idx_format's layout)
    expected = HEADER_BYTES + 4 * count + 8 * count + 8 * doc_indices
    size = os.path.getsize(idx_path)
    if size != expected:
        raise ValueError(
            f"{size:,} bytes, but its header describes {count:,} sequences and {doc_indices:,} "
            f"document indices ({expected:,} bytes): truncated, overwritten or not a megatron index"
        )
    lengths = np.fromfile(idx_path, dtype=np.int32, count=count, offset=HEADER_BYTES)
    if lengths.size != count:
        raise ValueError("truncated .idx")
    return lengths, dtype


def check_token_ids(bin_path: str, dtype, vocab_size: int, what: str) -> None:
    """Refuse a ``.bin`` holding a token id outside ``[0, vocab_size)`` (scanned in chunks with numpy
    over a memory map; files over :data:`TOKEN_SCAN_MAX_BYTES` are skipped).

    Args:
        bin_path: the ``PREFIX.bin`` file; dtype: its token dtype (from the ``.idx``);
        vocab_size: ids of the tokenizer; what: the setting and tokenizer for the message.

    Raises:
        ConfigError: naming the file, the first bad id and its position (in tokens).
    """
    if os.path.getsize(bin_path) > TOKEN_SCAN_MAX_BYTES:
        return
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    for start in range(0, tokens.size, _SCAN_CHUNK):
        chunk = tokens[start : start + _SCAN_CHUNK]
        bad = (chunk < 0) | (chunk >= vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise ConfigError(
                f"{bin_path} holds token id {chunk[i]} at token {start + i:,}, outside the vocabulary of "
                f"{what} (ids 0..{vocab_size - 1}): the file was not written with that tokenizer, or "
                f"it is damaged"
            )


def _check_prefixes(blend: Blend, key: str, stats: dict, dtypes: dict) -> None:
    """Check every prefix of ``blend`` (not yet in ``stats``): a finished build, both files, a readable
    ``.idx`` matching the ``.bin``'s size. Records ``stats[prefix] = (documents, tokens)`` and
    ``dtypes[prefix]`` (the token dtype of its ``.idx``)."""
    for p in blend[0]:
        unfinished = unfinished_build(p)
        if unfinished is not None:
            raise ConfigError(
                f"{key}: dataset prefix '{p}' is an unfinished k2-data build ({unfinished} exists): run the "
                f"same k2-data prepare command again to finish it"
            )
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
            lengths, dtype = _read_idx_header(p + ".idx")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}: {p}.idx is damaged: {e}; rebuild it (k2-data) or restore it") from None
        itemsize = np.dtype(dtype).itemsize
        tokens = int(lengths.sum(dtype=np.int64))
        if lengths.size == 0 or tokens == 0:
            raise ConfigError(f"{key}: dataset '{p}' holds no tokens")
        bin_bytes = os.path.getsize(p + ".bin")
        if bin_bytes != tokens * itemsize:
            raise ConfigError(
                f"{key}: {p}.bin has {bin_bytes} bytes but {p}.idx describes {tokens} tokens of "
                f"{itemsize} bytes ({tokens * itemsize} bytes); the pair is truncated or mismatched"
            )
        stats[p], dtypes[p] = (int(lengths.size), tokens), dtype


def _check_build_tokenizer(prefix: str, key: str, tok_path: str, tok_sha256: str, manifests: dict) -> None:
    """Refuse a dataset written by ``k2-data prepare`` with another tokenizer than ``data.tokenizer``
    (its manifest records the tokenizer's sha256): ids of one tokenizer read with another's vocabulary
    train silently on the wrong text. Datasets without a k2-data manifest are not checked here.
    ``manifests``: the manifests read so far, by path (:func:`k2.launcher.datasets.preprocess.build_manifest`)."""
    manifest = build_manifest(prefix, manifests)
    if manifest is None:
        return
    built = manifest.get("tokenizer", {})
    if built.get("sha256") not in (None, tok_sha256):
        raise ConfigError(
            f"{key}: '{prefix}' was tokenized by k2-data with {built.get('path')} (sha256 "
            f"{built['sha256'][:12]}...), not with data.tokenizer {tok_path} (sha256 {tok_sha256[:12]}...); "
            f"give data.tokenizer={built.get('path')}"
        )


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


def resolve_data(cfg: K2Config) -> ResolvedData:
    """Validate the ``data`` settings against each other and ``k2.model.vocab_size``; no heavy work.

    ``data.path`` null selects the embedded stdlib corpus (``data.vocab_size``, ``data.valid_fraction``,
    built by :func:`prepare_stdlib_corpus`; ``data.tokenizer`` / ``data.valid_path`` must then be null).
    Otherwise ``data.path`` is one prefix, a list of prefixes or a blend ``[w1, prefix1, w2, ...]``;
    ``data.valid_path`` the same or null (then ``data.split`` carves validation out of the train
    blend); ``data.tokenizer`` the ``tokenizer.json`` that produced the token ids.

    Checks: blend syntax; both ``PREFIX.bin`` and ``PREFIX.idx`` exist, the ``.idx`` is readable and
    the ``.bin`` size agrees with it; ``data.split`` parses and leaves every used split documents; the
    tokenizer exists, loads and has an EOD token; its vocab size <= ``k2.model.vocab_size``; every token
    id of each ``.bin`` up to :data:`TOKEN_SCAN_MAX_BYTES` is inside the tokenizer's vocabulary.

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

    if data.path is None:  # the embedded corpus; its settings are checked by k2.config.validate
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
    named: list = []  # the tokenizers the manifests in data.path / data.valid_path name
    train_blend = expand_manifests(parse_blend(data.path, "data.path"), "data.path", named)
    valid_blend = (
        None
        if data.valid_path is None
        else expand_manifests(parse_blend(data.valid_path, "data.valid_path"), "data.valid_path", named)
    )
    dtypes: dict = {}
    _check_prefixes(train_blend, "data.path", stats, dtypes)
    if valid_blend is not None:
        _check_prefixes(valid_blend, "data.valid_path", stats, dtypes)
        split = None
    else:
        split = _checked_split(data.split, train_blend, stats)
    tok_path, tok_vocab = _check_tokenizer(data, model_vocab, train_blend, valid_blend, dtypes, named)
    return ResolvedData(
        train_blend=train_blend,
        valid_blend=valid_blend,
        split=split,
        tokenizer_path=tok_path,
        tokenizer_vocab_size=tok_vocab,
        index_cache_dir=index_cache_dir,
        embedded=False,
        stats=stats,
    )


def _checked_split(split_setting, train_blend, stats: dict) -> str:
    """``data.split`` as megatron's split string, refused where it leaves a prefix without training (or,
    with a validation share, validation) documents: megatron slices each prefix's documents by the
    split's bookends."""
    vec = _parse_split(split_setting)
    total = sum(vec)
    beg, end = vec[0] / total, (vec[0] + vec[1]) / total
    for p in train_blend[0]:
        n = stats[p][0]
        if int(round(beg * n)) == 0:
            raise ConfigError(f"data.split={split_setting!r} leaves no training documents in '{p}' ({n} documents)")
        if vec[1] > 0 and int(round(end * n)) - int(round(beg * n)) == 0:
            raise ConfigError(
                f"data.split={split_setting!r} leaves no validation documents in '{p}' ({n} "
                f"documents); raise the valid share or give data.valid_path"
            )
    return ",".join(f"{x:g}" for x in vec)


def _check_tokenizer(data, model_vocab: int, train_blend, valid_blend, dtypes: dict, named: list) -> tuple[str, int]:
    """Load ``data.tokenizer`` and check that it built every prefix and holds every token id read;
    returns (its path, its vocab size). ``named``: the tokenizers the manifests of the settings name."""
    if data.tokenizer is None:
        hint = (
            f"data.tokenizer={named[0]}, the one its manifest names"
            if named
            else "data.tokenizer=/path/to/tokenizer.json"
        )
        raise ConfigError(
            "data.tokenizer is null but data.path is set: give the tokenizer.json that produced the "
            f"token ids of data.path ({hint})"
        )
    tok = load_user_tokenizer(data.tokenizer, model_vocab)
    tok_path = tok.path
    manifests: dict = {}  # (a sharded build's shards share one manifest: read once)
    for key, blend in (("data.path", train_blend), ("data.valid_path", valid_blend)):
        for p in (blend or ([], None))[0]:
            _check_build_tokenizer(p, key, tok_path, tok.unique_identifiers["sha256"], manifests)
            check_token_ids(p + ".bin", dtypes[p], tok.vocab_size, f"data.tokenizer {tok_path} ({key})")
    return tok_path, tok.vocab_size


# --------------------------------------------------------------------------- per schedule phase


def phase_data_settings(cfg: K2Config) -> list[tuple[Any, Any]]:
    """Per schedule phase, the ``(data.path, data.valid_path)`` it trains and validates on: its own
    ``schedule.phases.<i>.data.path`` / ``.valid_path``, else the previous phase's (the first phase:
    ``data.path`` / ``data.valid_path``). Reads the config only (no file is opened)."""
    path, valid = _plain(cfg.data.path), _plain(cfg.data.valid_path)
    out = []
    for ph in cfg.schedule.phases:
        if ph.data.path is not None:
            path = _plain(ph.data.path)
        if ph.data.valid_path is not None:
            valid = _plain(ph.data.valid_path)
        out.append((path, valid))
    return out


def resolve_phase_data(cfg: K2Config, base: ResolvedData) -> tuple[ResolvedData, ...]:
    """:class:`ResolvedData` of every schedule phase (index = ``Phase.index``), validated like
    ``data.path`` (files, token ids, split); phases with the same settings share one object, and a
    schedule that names no phase data gets ``base`` for every phase.

    Raises:
        ConfigError: a phase names data while ``data.path`` is null (the embedded corpus: give
            ``data.path`` and ``data.tokenizer`` explicitly), or a phase's data fails a check of
            :func:`resolve_data` (the message names ``schedule.phases.<i>.data``).
    """
    settings = phase_data_settings(cfg)
    first = (_plain(cfg.data.path), _plain(cfg.data.valid_path))
    if all(s == first for s in settings):
        return tuple(base for _ in settings)
    named = next(i for i, s in enumerate(settings) if s != first)
    if base.embedded:
        raise ConfigError(
            f"schedule.phases.{named}.data names its own data but data.path is null (the embedded corpus): "
            f"set data.path and data.tokenizer too (the embedded corpus's prefix and tokenizer.json are "
            f"under {stdlib_corpus_dir(cfg.data)})"
        )
    resolved: dict = {repr(first): base}
    out = []
    for i, (path, valid) in enumerate(settings):
        key = repr((path, valid))
        if key not in resolved:
            data = SimpleNamespace(
                **{k: cfg.data[k] for k in ("cache_dir", "split", "tokenizer", "vocab_size", "valid_fraction")},
                path=path,
                valid_path=valid,
            )
            view = SimpleNamespace(data=data, model=cfg.model)
            try:
                resolved[key] = resolve_data(view)
            except ConfigError as e:
                raise ConfigError(f"schedule.phases.{i}.data: {e}") from None
        out.append(resolved[key])
    return tuple(out)


def blend_key(resolved: ResolvedData) -> tuple:
    """What makes two :class:`ResolvedData` read the same samples (prefixes, weights, validation, split)."""
    t, v = resolved.train_blend, resolved.valid_blend
    return (tuple(t[0]), tuple(t[1] or ()), None if v is None else (tuple(v[0]), tuple(v[1] or ())), resolved.split)
