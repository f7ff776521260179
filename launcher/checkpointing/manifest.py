"""What a complete checkpoint holds, recorded in it, and the check of a checkpoint against that record.

``k2_manifest.json`` lists every other file of the checkpoint directory with its size in bytes and
its xxh3-64 checksum (:mod:`k2.launcher.checksums`, the checksum of every k2-launcher manifest). It is
written last and
atomically (a temporary name, then a rename), after every rank hashed the files it wrote
(:func:`rank_share`) and rank 0 gathered the entries; a checkpoint whose manifest is missing,
unreadable or disagrees with its files is damaged or incomplete. The manifest carries a checksum of
its own file list, so an edit of the manifest itself is found too.

Checkpoints written before manifests existed (no manifest, and ``k2_state.json`` without
``"manifest": true``) are accepted with a warning that they cannot be verified (:func:`check_structure`
checks only their required files; :func:`is_legacy` tells them apart).

Levels of :func:`verify` (``checkpoint.verify``): ``checksum`` (every file present, its size and its
checksum), ``size`` (present and its size; a stat per file), ``none`` (no check against the manifest).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from k2.config.validate import CHECKPOINT_VERIFY_LEVELS as VERIFY_LEVELS
from k2.launcher.checksums import ALGORITHM
from k2.launcher.checksums import file_checksum as _file_checksum
from k2.launcher.checksums import file_entries as _file_entries
from k2.launcher.progress import moved

MANIFEST_FILE = "k2_manifest.json"
STATE_FILE = "k2_state.json"
#: files a complete checkpoint always holds (megatron's ``metadata.json`` and ``.metadata``, the run state)
REQUIRED = ("metadata.json", ".metadata", STATE_FILE)
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")  # torch_dist: __<global rank>_<n>.distcp


def file_checksum(path) -> str:
    """The xxh3-64 checksum of the file at ``path`` as 16 hex digits (:func:`k2.launcher.checksums.file_checksum`),
    reporting each chunk to the hang watchdog (hashing a large checkpoint moves).

    Raises:
        OSError: the file cannot be read.
    """
    return _file_checksum(path, on_bytes=lambda _n: moved())


def file_entries(directory, names: Iterable[str]) -> dict:
    """``{name: {"size": bytes, "xxh3_64": hex}}`` for the files ``names`` of ``directory``."""
    return _file_entries(directory, names, on_bytes=lambda _n: moved())


def checkpoint_files(directory) -> list[str]:
    """Names of the regular files of a checkpoint directory except the manifest, sorted."""
    return sorted(p.name for p in Path(directory).iterdir() if p.is_file() and p.name != MANIFEST_FILE)


def rank_share(names: Iterable[str], rank: int, world_size: int) -> list[str]:
    """The files that ``rank`` of ``world_size`` hashes: the ``__<R>_<n>.distcp`` shards that global rank
    ``R`` wrote go to rank ``R mod world_size``, every other file to rank 0 (which wrote them)."""
    out = []
    for n in names:
        m = _SHARD.match(n)
        owner = int(m.group(1)) % world_size if m else 0
        if owner == rank:
            out.append(n)
    return out


def write_manifest(directory, entries: dict) -> Path:
    """Write ``k2_manifest.json`` into ``directory`` atomically; ``entries`` as :func:`file_entries`
    returns them, for every other file of the directory. Returns the manifest's path."""
    directory = Path(directory)
    files = dict(sorted(entries.items()))
    record = {
        "format": 1,
        "algorithm": ALGORITHM,
        "files": files,
        "files_" + ALGORITHM: _list_checksum(files),
        "total_bytes": sum(e["size"] for e in entries.values()),
    }
    tmp = directory / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, directory / MANIFEST_FILE)
    return directory / MANIFEST_FILE


def _list_checksum(files: dict) -> str:
    import xxhash

    return xxhash.xxh3_64(json.dumps(files, sort_keys=True).encode()).hexdigest()


def is_legacy(directory) -> bool:
    """True for a checkpoint written before manifests existed: no manifest, and its ``k2_state.json``
    does not say ``"manifest": true``. False when either says otherwise or the state cannot be read."""
    if (Path(directory) / MANIFEST_FILE).exists():
        return False
    try:
        state = json.loads((Path(directory) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return not (isinstance(state, dict) and state.get("manifest"))


def read_manifest(directory) -> tuple[dict | None, str | None]:
    """``(files, None)``: the manifest's ``{name: entry}``; or ``(None, problem)`` naming what is wrong."""
    path = Path(directory) / MANIFEST_FILE
    try:
        record = json.loads(path.read_text())
        files = record["files"]
        if record.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unknown manifest format (algorithm {record.get('algorithm')!r})")
        if record.get("files_" + ALGORITHM) != _list_checksum(files):
            raise ValueError("its own checksum does not match its file list (edited or damaged)")
    except FileNotFoundError:
        return None, f"{MANIFEST_FILE}: missing (the save did not finish, or the file was deleted)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{MANIFEST_FILE}: unreadable ({type(e).__name__}: {e})"
    return files, None


def check_structure(directory) -> list[str]:
    """Problems found without reading file contents: the required files, the manifest, every listed
    file present at its recorded size. A legacy checkpoint (:func:`is_legacy`) is only
    checked for the required files. Returns ``["<file>: <problem>", ...]``; empty when it passes."""
    directory = Path(directory)
    problems = [f"{n}: missing" for n in REQUIRED if not (directory / n).is_file()]
    if is_legacy(directory) and (directory / STATE_FILE).is_file():
        return problems
    files, problem = read_manifest(directory)
    if problem:
        return problems + [problem]
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            if f"{name}: missing" not in problems:
                problems.append(f"{name}: missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(
                f"{name}: {path.stat().st_size} bytes, the manifest records {entry['size']} (truncated or overwritten)"
            )
    return problems  # (a file the manifest does not list is not read by a load: not a problem)


def check_checksums(directory, names: Iterable[str]) -> list[str]:
    """Checksum problems among the files ``names`` (those the manifest lists and that exist at their
    size; :func:`check_structure` reports the rest). Returns ``["<file>: <problem>", ...]``."""
    directory = Path(directory)
    files, _ = read_manifest(directory)
    if not files:
        return []
    problems = []
    for name in names:
        entry, path = files.get(name), directory / name
        if entry is None or not path.is_file() or path.stat().st_size != entry["size"]:
            continue
        got = file_checksum(path)
        if got != entry[ALGORITHM]:
            problems.append(f"{name}: content changed (checksum {got}, the manifest records {entry[ALGORITHM]})")
    return problems


def verify(directory, level: str = "checksum", rank: int = 0, world_size: int = 1) -> list[str]:
    """Check a checkpoint against its manifest at ``level`` (module docstring); with ``world_size`` > 1,
    this rank's share of the checksums only (:func:`rank_share`), the structure in full.

    Returns:
        ``["<file>: <problem>", ...]``, empty when the checkpoint passes.

    Raises:
        ValueError: an unknown level.
    """
    if level not in VERIFY_LEVELS:
        raise ValueError(f"verify level {level!r}; allowed: {', '.join(VERIFY_LEVELS)}")
    if level == "none":
        return []
    problems = check_structure(directory)
    if level == "checksum" and not problems and not is_legacy(directory):
        problems = check_checksums(directory, rank_share(checkpoint_files(directory), rank, world_size))
    return problems
