"""Names and completeness of checkpoints in ``<run.dir>/checkpoints/`` (the layout of
:mod:`k2.launcher.checkpointing`): ``iter_NNNNNNN`` directories, ``latest``, ``k2_state.json``, and the
manifest (:mod:`k2.launcher.checkpointing.manifest`) against which a checkpoint is judged complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

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


def latest_checkpoint(run_dir) -> Optional[Path]:
    """The checkpoint ``<run.dir>/checkpoints/latest`` names, or None when there is none.

    Raises:
        ConfigError: ``latest`` names a directory that is not a complete checkpoint.
    """
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.exists():
        return None
    path = checkpoints_dir(run_dir) / pointer.read_text().strip()
    read_state(path)  # complete?
    return path


def resume_point(run_dir, root=None) -> tuple[Optional[Path], Optional[str]]:
    """The checkpoint a ``resume=auto`` run continues from, and a line for the log when ``latest`` could
    not say it.

    ``latest`` naming a directory -> that one (damage inside it is reported by :func:`read_state` and
    the manifest check, naming the checkpoints that verify). ``latest`` missing, empty, or naming a
    directory that does not exist -> the newest checkpoint
    whose files match its manifest (:func:`complete_checkpoint_names`), with a note naming the marker.
    No checkpoint at all and no ``latest`` -> ``(None, None)``: a fresh start (also for a run killed
    before its first save). ``root``: a checkpoints directory to look in instead of ``run_dir``'s.

    Raises:
        ConfigError: ``latest`` exists but names nothing usable and no checkpoint verifies (the marker
            and what it names are in the message, with how to start afresh).
    """
    root = Path(root) if root is not None else checkpoints_dir(run_dir)
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    if named and (root / named).is_dir():  # damage inside it is judged (and named) by the caller
        return root / named, None
    if pointer.exists() and not pointer.is_file():
        named = None
    found = complete_checkpoint_names(root)
    if named is None and not pointer.exists():
        problem = f"{pointer} is missing"
    elif not named:
        problem = f"{pointer} is empty"
    else:
        problem = f"{pointer} names {named}, which does not exist"
    if found:
        return root / found[-1], f"{problem}; resuming from the newest checkpoint that verifies: {found[-1]}"
    if not pointer.exists():
        return None, None
    raise ConfigError(f"{problem} and no checkpoint in {root} verifies: delete {pointer} to start the run "
                      "afresh, or choose a new run.dir")


def read_state(path) -> dict:
    """``k2_state.json`` of the checkpoint at ``path`` (written last, so its presence marks a complete
    checkpoint).

    Raises:
        ConfigError: ``path`` is missing, a partial save, or not a k2-launcher checkpoint.
    """
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise ConfigError(f"checkpoint {path} is a partial save (killed mid-way); resume from a "
                          f"complete one: {', '.join(complete_checkpoint_names(path.parent)) or 'none exists'}")
    state_file = path / STATE_FILE
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist")
    if not state_file.exists() or not (path / "metadata.json").exists():
        missing = STATE_FILE if not state_file.exists() else "metadata.json"
        raise ConfigError(f"{path} is not a complete k2-launcher checkpoint ({missing} is missing)"
                          f"{_alternatives(path)}")
    try:
        return json.loads(state_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"checkpoint {path}: {STATE_FILE} is corrupt ({e})") from None


def saved_checkpoint_names(root: Path) -> list[str]:
    """Names of the ``iter_*`` directories under ``root`` that hold a ``k2_state.json`` (saves that
    reached their last step, complete or damaged since), sorted by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("iter_") and (p / STATE_FILE).exists())


def complete_checkpoint_names(root: Path) -> list[str]:
    """Names of the checkpoints under ``root`` that pass
    :func:`k2.launcher.checkpointing.manifest.check_structure` (every file of the manifest present at its
    size; checksums are not read), sorted by step."""
    return [n for n in saved_checkpoint_names(root) if not check_structure(Path(root) / n)]


def _alternatives(path: Path) -> str:
    """``; checkpoints in <dir> that verify ...: a, b; resume from one with resume.from=<newest>``."""
    names = [n for n in complete_checkpoint_names(path.parent) if n != path.name]
    if not names:
        return (f"; no other checkpoint in {path.parent} verifies: start a new run.dir, or delete the "
                "damaged checkpoint (and checkpoints/latest) to start afresh")
    return (f"; checkpoints in {path.parent} that verify (files and sizes): {', '.join(names)}; resume "
            f"from one with resume.from={path.parent / names[-1]}")


def damaged_checkpoint_error(path, problems: list[str]) -> ConfigError:
    """The error for a damaged or incomplete checkpoint: names it, each problem file (at most 5 listed),
    the checkpoints next to it that verify and the ``resume.from=...`` override that uses the newest."""
    path = Path(path)
    shown = "; ".join(problems[:5]) + (f"; ... ({len(problems) - 5} more)" if len(problems) > 5 else "")
    return ConfigError(f"checkpoint {path} is damaged or incomplete: {shown}{_alternatives(path)}")


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
