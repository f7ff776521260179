"""Names and completeness of checkpoints in ``<run.dir>/checkpoints/`` (the layout of
:mod:`k2.launcher.checkpointing`): ``iter_NNNNNNN`` directories, ``latest``, and ``k2_state.json``, whose
presence marks a complete checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from k2.config.errors import ConfigError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_FILE = "k2_state.json"
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
        raise ConfigError(f"{path} is not a complete k2-launcher checkpoint (no {STATE_FILE} or "
                          "metadata.json); complete ones in its directory: "
                          f"{', '.join(complete_checkpoint_names(path.parent)) or 'none'}")
    try:
        return json.loads(state_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"checkpoint {path}: {STATE_FILE} is corrupt ({e})") from None


def complete_checkpoint_names(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("iter_") and (p / STATE_FILE).exists())
