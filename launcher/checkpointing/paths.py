"""Names and completeness of checkpoints in ``<run.dir>/checkpoints/`` (the layout of
:mod:`k2.launcher.checkpointing`): ``iter_NNNNNNN`` directories, ``latest``, ``k2_state.json``, and the
manifest (:mod:`k2.launcher.checkpointing.manifest`) against which a checkpoint is judged complete.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from k2.config.errors import ConfigError
from k2.launcher.checkpointing.manifest import STATE_FILE, check_structure

CHECKPOINTS = "checkpoints"
LATEST = "latest"
CONFIG_FILE = "config.yaml"
PARTIAL_SUFFIX = ".partial"


def iter_name(step: int) -> str:
    """``iter_0000042`` for step 42 (Megatron-LM's naming)."""
    return f"iter_{step:07d}"


def checkpoints_dir(run_dir) -> Path:
    return Path(run_dir) / CHECKPOINTS


def latest_checkpoint(run_dir) -> Path | None:
    """The checkpoint ``<run.dir>/checkpoints/latest`` names, or None when there is none.

    Raises:
        ConfigError: ``latest`` is not a file, names something outside ``checkpoints/``
            (:func:`read_latest`), or names a directory that is not a complete checkpoint.
    """
    root = checkpoints_dir(run_dir)
    named = read_latest(root)
    if named is None:
        return None
    path = root / named
    read_state(path)  # complete?
    return path


#: the most of a ``latest`` file that is read (it holds one directory name)
_LATEST_BYTES = 4096


def _file_kind(path: Path) -> str:
    """What ``path`` is when it is not a regular file: a directory, a FIFO, ..."""
    mode = path.stat().st_mode
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def read_latest(root) -> str | None:
    """The checkpoint name the ``latest`` file of the checkpoints directory ``root`` holds: None when
    there is no ``latest`` (or it is a dangling link), ``""`` when it is empty. A pointer may name only a
    checkpoint of ``root`` itself -- one directory name, not a path, and not a link to a directory
    elsewhere -- so that a run never resumes another run's checkpoint without being asked to
    (``resume.from`` names one explicitly).

    Raises:
        ConfigError: ``latest`` is not a regular file (e.g. a directory, which the commit of the next
            checkpoint could not replace); it names something outside ``root`` (a path, ``..``, a link
            out). The message names the file, what it holds and the checkpoints it may name.
    """
    root = Path(root)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    if not pointer.is_file():
        raise ConfigError(
            f"{pointer} is {_file_kind(pointer)}, not the file k2-train writes there (one line: the "
            f"name of the newest checkpoint); move it away (the run then resumes from the newest "
            f"checkpoint that verifies{_names_in(root)}) or pass resume.from=<a checkpoint>"
        )
    with open(pointer, encoding="utf-8", errors="replace") as f:
        named = f.read(_LATEST_BYTES).strip()
    outside = _outside(root, named)
    if named and outside:
        raise ConfigError(
            f"{pointer} names {named!r}, which is not a checkpoint of {root} ({outside}): a pointer "
            f"may name only a checkpoint of its own run{_names_in(root)}; write one of those "
            "names into it, delete it (the run then resumes from the newest checkpoint that "
            "verifies), or resume another run's checkpoint explicitly with resume.from=PATH"
        )
    return named


def _outside(root: Path, named: str) -> str | None:
    """Why ``named`` (a pointer's text) leaves ``root``, or None when it names an entry of ``root``."""
    if "/" in named or "\0" in named or named in (".", ".."):
        return "a path, not the name of a directory in it"
    target = root / named
    if target.is_symlink():
        return f"a link to {os.readlink(target)}"
    return None


def _names_in(root: Path) -> str:
    names = saved_checkpoint_names(root)
    return f" ({', '.join(names)})" if names else " (none there)"


def resume_point(run_dir, root=None) -> tuple[Path | None, str | None]:
    """The checkpoint a ``resume=auto`` run continues from, and a line for the log when ``latest`` could
    not say it.

    ``latest`` naming a directory -> that one (damage inside it is reported by :func:`read_state` and
    the manifest check, naming the checkpoints that verify). ``latest`` missing, empty, or naming a
    directory that does not exist -> the newest checkpoint
    whose files match its manifest (:func:`complete_checkpoint_names`), with a note naming the marker.
    No checkpoint at all and no ``latest`` -> ``(None, None)``: a fresh start (also for a run killed
    before its first save). ``root``: a checkpoints directory to look in instead of ``run_dir``'s.

    Raises:
        ConfigError: ``latest`` is not a file or points outside ``root`` (:func:`read_latest`); it
            exists but names nothing usable and no checkpoint verifies (the marker and what it names are
            in the message, with how to start afresh).
    """
    root = Path(root) if root is not None else checkpoints_dir(run_dir)
    pointer = root / LATEST
    named = read_latest(root)
    if named and (root / named).is_dir():  # damage inside it is judged (and named) by the caller
        return root / named, None
    found = complete_checkpoint_names(root)
    if named is None:
        problem = f"{pointer} is missing"
    elif not named:
        problem = f"{pointer} is empty"
    else:
        problem = f"{pointer} names {named}, which does not exist"
    if found:
        return root / found[-1], f"{problem}; resuming from the newest checkpoint that verifies: {found[-1]}"
    if named is None:
        return None, None
    raise ConfigError(
        f"{problem} and no checkpoint in {root} verifies: delete {pointer} to start the run "
        "afresh, or choose a new run.dir"
    )


def read_state(path) -> dict:
    """``k2_state.json`` of the checkpoint at ``path`` (written last, so its presence marks a complete
    checkpoint).

    Raises:
        ConfigError: ``path`` is missing, a partial save, or not a k2-launcher checkpoint.
    """
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise ConfigError(
            f"checkpoint {path} is a partial save (killed mid-way); resume from a "
            f"complete one: {', '.join(complete_checkpoint_names(path.parent)) or 'none exists'}"
        )
    state_file = path / STATE_FILE
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist")
    if not state_file.exists() or not (path / "metadata.json").exists():
        missing = STATE_FILE if not state_file.exists() else "metadata.json"
        raise ConfigError(
            f"{path} is not a complete k2-launcher checkpoint ({missing} is missing){_alternatives(path)}"
        )
    try:
        return json.loads(state_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"checkpoint {path}: {STATE_FILE} is corrupt ({e})") from None


def saved_checkpoint_names(root: Path) -> list[str]:
    """Names of the ``iter_*`` directories under ``root`` that hold a ``k2_state.json`` (saves that
    reached their last step, complete or damaged since), sorted by step; links are not followed."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        p.name
        for p in root.iterdir()  # (a link to a directory elsewhere is not one of them)
        if p.name.startswith("iter_") and not p.is_symlink() and p.is_dir() and (p / STATE_FILE).exists()
    )


def complete_checkpoint_names(root: Path) -> list[str]:
    """Names of the checkpoints under ``root`` that pass
    :func:`k2.launcher.checkpointing.manifest.check_structure` (every file of the manifest present at its
    size; checksums are not read), sorted by step."""
    return [n for n in saved_checkpoint_names(root) if not check_structure(Path(root) / n)]


def _alternatives(path: Path) -> str:
    """``; checkpoints in <dir> that verify ...: a, b; resume from one with resume.from=<newest>``."""
    names = [n for n in complete_checkpoint_names(path.parent) if n != path.name]
    if not names:
        return (
            f"; no other checkpoint in {path.parent} verifies: start a new run.dir, or delete the "
            "damaged checkpoint (and checkpoints/latest) to start afresh"
        )
    return (
        f"; checkpoints in {path.parent} that verify (files and sizes): {', '.join(names)}; resume "
        f"from one with resume.from={path.parent / names[-1]}"
    )


def damaged_checkpoint_error(path, problems: list[str]) -> ConfigError:
    """The error for a damaged or incomplete checkpoint: names it, each problem file (at most 5 listed),
    the checkpoints next to it that verify and the ``resume.from=...`` override that uses the newest."""
    path = Path(path)
    shown = "; ".join(problems[:5]) + (f"; ... ({len(problems) - 5} more)" if len(problems) > 5 else "")
    return ConfigError(f"checkpoint {path} is damaged or incomplete: {shown}{_alternatives(path)}")


def unsafe_checkpoint_error(path, problems: list[str]) -> ConfigError:
    """The error for a checkpoint whose pickled parts name globals outside the allow-list of
    :mod:`k2.launcher.checkpointing.unpickle` (they would run code when loaded): names it and each part."""
    shown = "; ".join(problems[:3]) + (f"; ... ({len(problems) - 3} more)" if len(problems) > 3 else "")
    return ConfigError(
        f"checkpoint {path} is refused: its pickled data would call code a checkpoint never "
        f"holds ({shown}); nothing of it was loaded. It was not written by k2-launcher, or it was "
        "altered (the manifest's checksums show integrity, not who wrote it: docs/checkpoints.md, "
        "'What a checkpoint is trusted with')"
    )


def check_checkpoint_files(path, level: str) -> None:
    """Without reading file contents: refuse a checkpoint whose files disagree with its manifest
    (``level`` is ``checkpoint.verify``; ``none`` skips the check).

    Raises:
        ConfigError: :func:`damaged_checkpoint_error`.
    """
    if level == "none":
        return
    problems = check_structure(path)
    if problems:
        raise damaged_checkpoint_error(path, problems)
