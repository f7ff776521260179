"""``k2-data verify``: the outputs of k2-data read whole and compared with their manifest.

What is checked (:func:`targets`): the manifests named on the command line (a ``*.manifest.json``, the
embedded corpus's ``manifest.json``, or a dataset prefix -- ``PREFIX``, ``PREFIX.bin``, a shard -- of a
k2-data build: its whole build is checked); with none, ``prepare.output``'s manifest when that is set,
else the datasets of ``data.path`` / ``data.valid_path`` (each against its build's manifest), else the
embedded corpus. Each file's presence, size and xxh3-64 checksum (:func:`k2.launcher.datasets.verify.verify_files`):
one line per bad file on stderr as it is found, a progress bar of the bytes read (``prepare.progress``),
and a summary line with the rate.

Exit status: 0 every file matches; 2 a file is missing, of another size or content (or a bad setting,
a path that is no k2-data output).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from k2.config import ConfigError, load_config
from k2.launcher.datasets.corpus import stdlib_corpus_dir
from k2.launcher.datasets.preprocess import MANIFEST_SUFFIX, output_prefix
from k2.launcher.datasets.resolve import expand_manifests, parse_blend
from k2.launcher.datasets.verify import (
    EMBEDDED_MANIFEST,
    dataset_items,
    is_manifest_path,
    manifest_for,
    manifest_items,
    verify_files,
)

__all__ = ["targets", "verify_command"]


def _manifest_of(path: str) -> str:
    """The manifest a command-line ``path`` names (module docstring)."""
    path = os.path.abspath(os.path.expanduser(path))
    if is_manifest_path(path):
        return path
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    found = manifest_for(path)
    if found is None:
        raise ConfigError(
            f"k2-data verify: {path} is neither a k2-data manifest nor a dataset prefix of a k2-data "
            f"build (no {os.path.basename(path)}{MANIFEST_SUFFIX} or {EMBEDDED_MANIFEST} lists it)"
        )
    return found[0]


def targets(paths: Sequence[str], overrides: Sequence[str]) -> tuple[list, str]:
    """``(items for verify_files, what they are)`` of the command line (module docstring)."""
    if paths:
        manifests = list(dict.fromkeys(_manifest_of(p) for p in paths))
        return [i for m in manifests for i in manifest_items(m)], ", ".join(manifests)
    cfg = load_config(list(overrides))
    if cfg.prepare.output is not None:
        m = output_prefix(cfg) + MANIFEST_SUFFIX
        return manifest_items(m), m
    if cfg.data.path is None:
        m = os.path.join(stdlib_corpus_dir(cfg.data), EMBEDDED_MANIFEST)
        return manifest_items(m), m
    prefixes: list[str] = []
    for key in ("path", "valid_path"):
        if cfg.data[key] is not None:
            prefixes += expand_manifests(parse_blend(cfg.data[key], f"data.{key}"), f"data.{key}", [])[0]
    items, unlisted = dataset_items(prefixes)
    if unlisted:
        raise ConfigError(
            f"k2-data verify: no k2-data manifest lists {unlisted[0]} (not written by k2-data: "
            "nothing to verify it against)"
        )
    return items, "the datasets of data.path / data.valid_path"


def verify_command(args: Sequence[str]) -> int:
    """``k2-data verify [PATH ...] [HYDRA_OVERRIDE ...]``: the exit status of the module docstring."""
    paths = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    items, what = targets(paths, overrides)
    progress = bool(load_config(overrides).prepare.progress) and sys.stderr.isatty()
    report = verify_files(
        items,
        progress=progress,
        on_problem=lambda line: print(f"k2-data: damaged: {line}", file=sys.stderr, flush=True),
    )
    if report.problems:
        print(
            f"k2-data: verify: {len(report.problems)} of {report.files} files damaged ({what}); rebuild them with "
            "k2-data (a killed or changed build reruns from its inputs) or restore them",
            file=sys.stderr,
        )
        return 2
    print(f"k2-data: verify: {report.files} files match {what}: {report.rate()}")
    return 0
