"""The planner's one entry point (``k2.launcher.planning``'s docstring): code outside the package imports
the planner from the package only -- ``k2-plan``, the benchmarks, ``k2-train``'s checks -- and every
name the package offers resolves to the function its module defines. (That importing the package for
the config-only check does not import megatron-core is
``test_cli.test_k2_train_refuses_a_bad_setting_without_importing_megatron``.)
"""

from __future__ import annotations

import importlib

from support import REPO
from support.layering import imports, modules, package_dirs

PLANNING = "k2.launcher.planning"


def reaches_into_planning(root) -> list[str]:
    """``file:line: module`` of every import of one of the planner's modules from outside the package
    (the product's packages and the ``benchmarks/`` scripts)."""
    mods = modules(root, package_dirs(root / "pyproject.toml"))
    files = [(m, p) for m, p in mods.items() if m != PLANNING and not m.startswith(PLANNING + ".")]
    files += [(f"benchmarks.{p.stem}", p) for p in sorted((root / "benchmarks").glob("*.py"))]
    found = []
    for mod, path in files:
        for target, line in imports(path, mod, path.name == "__init__.py"):
            if target.startswith(PLANNING + ".") and target in mods:
                found.append(f"{path.relative_to(root)}:{line}: {target}")
    return found


def test_everything_outside_imports_the_planner_from_its_entry_point():
    found = reaches_into_planning(REPO)
    assert not found, "import these from k2.launcher.planning instead:\n" + "\n".join(found)


def test_the_check_sees_an_import_of_a_planner_module(tmp_path):
    """The check fails on a copy of the tree with one caller reaching into a planner module."""
    import shutil

    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")  # the other package folders: absent
    shutil.copytree(REPO / "launcher", tmp_path / "launcher", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "benchmarks").mkdir()
    plan = tmp_path / "launcher" / "plan.py"
    plan.write_text(plan.read_text() + "\nfrom k2.launcher.planning.cluster import plan_cluster\n")
    assert reaches_into_planning(tmp_path) == [
        f"launcher/plan.py:{len(plan.read_text().splitlines())}: {PLANNING}.cluster"
    ]


def test_every_public_name_resolves_to_its_module():
    planning = importlib.import_module(PLANNING)
    for name in planning.__all__:
        obj = getattr(planning, name)
        assert obj.__module__ == f"{PLANNING}.{planning._ENTRY[name]}", name
