"""The config tree: where the recipes are and which recipes a config group holds.

The tree is the ``k2.recipes`` package (the repository's ``recipes/`` folder, installed as package data), so
an installed wheel composes configs from any working directory. A group's choices are its recipe files: a
setting chosen by recipe (``optim=<name>``, ``plan.hardware=<name>``) allows exactly the names found here, and
adding a recipe file adds a choice.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["RECIPES_DIR", "recipe_names", "repo_root"]


def _package_dir(name: str) -> Path:
    """The folder of the installed package ``name``."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed (pip install -e . installs it with k2-launcher)")
    return Path(spec.submodule_search_locations[0])


#: the folder of the config tree (``recipes/`` in the repository)
RECIPES_DIR = _package_dir("k2.recipes")


def repo_root() -> Path | None:
    """The root folder of the repository this code runs from (the one holding ``recipes/`` and
    ``pyproject.toml``), or None for an installed wheel (no checkout). The folder the benchmarks run their
    trainers in, so that relative settings (``data.cache_dir=data_cache``) mean what they mean to a user
    who runs ``k2-train`` there."""
    root = RECIPES_DIR.parent
    return root if (root / "pyproject.toml").is_file() else None


def recipe_names(group: str) -> tuple[str, ...]:
    """The recipes of config group ``group``: the stems of ``recipes/<group>/*.yaml``, sorted (empty for a
    folder that does not exist)."""
    return tuple(sorted(p.stem for p in (RECIPES_DIR / group).glob("*.yaml")))
