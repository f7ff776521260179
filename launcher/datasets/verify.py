"""The outputs of ``k2-data`` checked against their manifest: ``k2-data verify`` and ``data.verify``.

Every manifest ``k2-data`` writes -- ``PREFIX.manifest.json`` of ``prepare.input`` (one build or an array
build), ``manifest.json`` of the embedded corpus -- lists every output file with its size and xxh3-64
checksum (:mod:`k2.launcher.checksums`). :func:`verify_files` reads each file whole and compares; a
missing file, another size or another checksum is one problem line naming the file. Reading is the cost
(about the disk's or the page cache's speed: the hash itself runs at ~5 GB/s per core), so ``k2-train``
checks only sizes and index headers unless ``data.verify=true`` (:func:`verify_datasets`).

Also here: where the manifest of a dataset is (:func:`manifest_for`), and the datasets a manifest lists
(:func:`manifest_datasets`: ``data.path=PREFIX.manifest.json``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from k2.config.errors import ConfigError
from k2.launcher.checksums import ALGORITHM, file_checksum
from k2.launcher.datasets.preprocess import MANIFEST_SUFFIX, build_manifest_path, read_json

__all__ = [
    "EMBEDDED_MANIFEST",
    "VerifyReport",
    "is_manifest_path",
    "manifest_datasets",
    "manifest_for",
    "verify_datasets",
    "verify_files",
]

#: the embedded corpus's manifest, in its directory beside train.bin / valid.bin
EMBEDDED_MANIFEST = "manifest.json"


def is_manifest_path(value: str) -> bool:
    """Whether a ``data.path`` entry names a manifest instead of a dataset prefix."""
    return value.endswith(MANIFEST_SUFFIX) or os.path.basename(value) == EMBEDDED_MANIFEST


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such manifest") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable k2-data manifest ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("outputs"), dict):
        raise ConfigError(f"{path}: not a k2-data manifest (no 'outputs' with sizes and checksums)")
    return manifest


def manifest_datasets(path: str) -> tuple[list[str], list[int], str | None]:
    """``(prefixes, tokens of each, tokenizer path)`` of the datasets the manifest at ``path`` lists, in
    its order (every shard of an array build; ``train`` only of the embedded corpus).

    Raises:
        ConfigError: not a readable k2-data manifest.
    """
    manifest = _load(path)
    d = os.path.dirname(os.path.abspath(path))
    if "datasets" in manifest:
        sets = manifest["datasets"]
        return (
            [os.path.join(d, s["prefix"]) for s in sets],
            [int(s["tokens"]) for s in sets],
            manifest.get("tokenizer", {}).get("path"),
        )
    return [os.path.join(d, "train")], [int(manifest["tokens"]["train"])], os.path.join(d, "tokenizer.json")


def manifest_for(prefix: str, cache: dict | None = None) -> tuple[str, dict] | None:
    """``(manifest path, manifest)`` of the k2-data build that wrote the dataset ``prefix`` (its
    ``PREFIX.manifest.json``, a sharded build's ``BASE.manifest.json``, the embedded corpus's
    ``manifest.json`` beside it), or None (not written by k2-data, or the manifest is unreadable)."""
    found = build_manifest_path(prefix, cache)
    if found is not None:
        return found
    embedded = os.path.join(os.path.dirname(prefix), EMBEDDED_MANIFEST)
    manifest = read_json(embedded)
    name = os.path.basename(prefix)
    if manifest is not None and f"{name}.bin" in manifest.get("outputs", {}):
        return embedded, manifest
    return None


@dataclass
class VerifyReport:
    """What :func:`verify_files` found: ``files`` and ``bytes`` read, ``seconds``, ``problems`` (one line per
    bad file: ``PATH: what is wrong``)."""

    files: int
    bytes: int
    seconds: float
    problems: list

    def rate(self) -> str:
        gb = self.bytes / 1e9
        return f"{gb:.2f} GB in {self.seconds:.2f} s ({gb / max(self.seconds, 1e-9):.2f} GB/s)"


def _problem(path: str, entry: dict, manifest_path: str, on_bytes) -> str | None:
    if not isinstance(entry, dict) or ALGORITHM not in entry:
        return f"{path}: {manifest_path} records no {ALGORITHM} checksum for it (written by an older k2-data)"
    if not os.path.isfile(path):
        return f"{path}: missing ({manifest_path} lists it)"
    size = os.path.getsize(path)
    if size != entry["size"]:
        return f"{path}: {size} bytes, {manifest_path} records {entry['size']} (truncated or overwritten)"
    got = file_checksum(path, on_bytes)
    if got != entry[ALGORITHM]:
        return (
            f"{path}: content changed ({ALGORITHM} {got}, {manifest_path} records {entry[ALGORITHM]}): "
            "the file is damaged"
        )
    return None


def verify_files(
    items: Iterable[tuple[str, dict, str]], progress: bool = False, on_problem: Callable[[str], None] | None = None
) -> VerifyReport:
    """Check ``(path, manifest entry {"size", "xxh3_64"}, manifest path)`` items: presence, size,
    checksum. ``progress``: a bar of the bytes read on stderr; ``on_problem``: called with each problem
    line as it is found."""
    from tqdm import tqdm

    items = list(items)
    total = sum(e.get("size", 0) for _, e, _ in items if isinstance(e, dict))
    t0, problems, read = time.perf_counter(), [], 0
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="k2-data: verify",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        for path, entry, manifest_path in items:

            def on_bytes(n: int) -> None:
                nonlocal read
                read += n
                bar.update(n)

            problem = _problem(path, entry, manifest_path, on_bytes)
            if problem is not None:
                problems.append(problem)
                if on_problem is not None:
                    on_problem(problem)
    return VerifyReport(len(items), read, time.perf_counter() - t0, problems)


def manifest_items(manifest_path: str) -> list[tuple[str, dict, str]]:
    """Every output of the manifest at ``manifest_path`` as :func:`verify_files` items."""
    manifest = _load(manifest_path)
    d = os.path.dirname(os.path.abspath(manifest_path))
    return [(os.path.join(d, n), e, manifest_path) for n, e in sorted(manifest["outputs"].items())]


def dataset_items(prefixes: Iterable[str]) -> tuple[list, list[str]]:
    """``(items, prefixes without a manifest)``: the ``.bin`` / ``.idx`` of every dataset prefix with its
    manifest's entries, for :func:`verify_files`."""
    items, unlisted, cache = [], [], {}
    for p in dict.fromkeys(prefixes):
        found = manifest_for(p, cache)
        if found is None:
            unlisted.append(p)
            continue
        path, manifest = found
        name = os.path.basename(p)
        items += [(p + ext, manifest["outputs"].get(name + ext), path) for ext in (".bin", ".idx")]
    return items, unlisted


def verify_datasets(prefixes: Iterable[str], log: Callable[[str], None], progress: bool = False) -> None:
    """``data.verify=true``: every dataset ``k2-train`` will read, checked against its manifest before
    any rank starts; the cost is logged, and datasets with no k2-data manifest are named.

    Raises:
        ConfigError: the first damaged file (one line naming it and the manifest).
    """
    items, unlisted = dataset_items(prefixes)
    report = verify_files(items, progress=progress)
    if report.problems:
        n = len(report.problems)
        more = f" ({n - 1} more damaged: k2-data verify lists them)" if n > 1 else ""
        raise ConfigError(f"data.verify: {report.problems[0]}{more}; rebuild it with k2-data or restore it")
    log(
        f"k2-train: data.verify: {report.files} files of {len(items) // 2} datasets match their k2-data manifests: "
        f"{report.rate()}"
        + (
            f"; no manifest (not written by k2-data: sizes and index headers checked only) for "
            f"{', '.join(unlisted[:3])}{' ...' if len(unlisted) > 3 else ''}"
            if unlisted
            else ""
        )
    )
