"""Type-check k2-launcher's packages with mypy, as configured in pyproject.toml's ``[tool.mypy]``.

Usage (from anywhere; ``.ci/run`` and the pre-commit hook run it)::

    .venv/bin/python scripts/typecheck.py [extra mypy arguments]

Why a script and not a bare ``mypy``: the packages install as ``k2.<name>`` from top-level folders
(pyproject.toml's ``package-dir``: ``k2.config`` is ``config/``), and an editable install maps them with an
import hook, which mypy cannot follow (it finds modules by their place on disk). So this lays out
``build/typecheck/k2/<name>`` as links to those folders (``build/`` is ignored by git), checks the packages
from there (``mypy_path``), and prints every path as the file's own path in the repository.

Exit status: mypy's (0: no error).
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: where the ``k2`` namespace is laid out for mypy (pyproject.toml's ``[tool.mypy] mypy_path``)
TREE = ROOT / "build" / "typecheck"


def lay_out_namespace(root: Path = ROOT, tree: Path = TREE) -> dict[str, str]:
    """``tree/k2/<name>`` -> ``root/<folder>`` for each package of ``package-dir``; returns the prefix of each
    laid-out package's paths (relative to ``root``) -> the folder's (to print the repository's paths)."""
    package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    (tree / "k2").mkdir(parents=True, exist_ok=True)
    prefixes = {}
    for package, folder in package_dir.items():
        link = tree / Path(*package.split("."))
        target = os.path.relpath(root / folder, link.parent)
        if not (link.is_symlink() and os.readlink(link) == target):
            link.unlink(missing_ok=True)
            link.symlink_to(target, target_is_directory=True)
        prefixes[f"{link.relative_to(root)}/"] = f"{folder}/"
    return prefixes


def main(argv: list[str]) -> int:
    from mypy import api

    os.chdir(ROOT)
    prefixes = lay_out_namespace()
    out, err, status = api.run(argv)
    for line in out.splitlines():
        for laid_out, folder in prefixes.items():
            if line.startswith(laid_out):
                line = folder + line[len(laid_out) :]
                break
        print(line)
    print(err, end="", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
