"""The structure of the project, checked from the source: imports point only down the layers
(``k2.config``'s docstring), siblings of a layer do not import each other, there is no import cycle, no
module imports a bare top-level folder (``model``, ``launcher``, ...), no product module is much past
500 lines and no product function past 80, and pyproject.toml installs every package folder under the ``k2`` namespace.

The checker is shown to fail: on a copy of the tree with one upward import planted, and with a cycle
planted, it reports exactly those.
"""

from __future__ import annotations

import ast
import shutil
import tomllib

import pytest

from support import REPO
from support.layering import LAYERS, check, modules, package_dirs

DIRS = package_dirs(REPO / "pyproject.toml")
PRODUCT = [d for p, d in DIRS.items() if p != "k2.recipes"]


def test_imports_point_down_without_cycles():
    violations = check(REPO, DIRS)
    assert not violations, "\n".join(map(str, violations))


def test_every_module_belongs_to_a_layer():
    from support.layering import unit_of

    unplaced = [m for m in modules(REPO, DIRS) if unit_of(m) is None and not m.startswith("k2.recipes")]
    assert not unplaced, f"modules outside every layer of support/layering.py LAYERS: {unplaced}"
    assert LAYERS[0] == ["k2.config"]


@pytest.fixture
def tree_copy(tmp_path):
    for folder in PRODUCT:
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_checker_reports_a_planted_upward_import(tree_copy):
    f = tree_copy / "model" / "flops.py"
    f.write_text(f.read_text() + "\nfrom k2.launcher.tools.sbatch import MASTER_PORT_BASE  # planted\n")
    found = check(tree_copy, DIRS)
    assert [(v.kind, v.module, v.target) for v in found] == [("upward", "k2.model.flops", "k2.launcher.tools.sbatch")]


def test_checker_reports_a_planted_cycle_and_a_sibling_import(tree_copy):
    # a cycle inside one package (k2.schedules.wsd -> k2.schedules.resolve -> k2.schedules.wsd)
    f = tree_copy / "schedules" / "wsd.py"
    f.write_text(f.read_text() + "\n\ndef _planted():\n    from k2.schedules.resolve import resolve_schedule\n")
    # and one building block importing another
    g = tree_copy / "launcher" / "planning" / "report.py"
    g.write_text(g.read_text() + "\nimport k2.launcher.datasets.corpus  # planted\n")
    found = check(tree_copy, DIRS)
    kinds = sorted((v.kind, v.target) for v in found)
    assert kinds == [("cycle", "k2.schedules.resolve"), ("sibling", "k2.launcher.datasets.corpus")], found
    cycle = next(v for v in found if v.kind == "cycle")
    assert cycle.module == "k2.schedules.resolve -> k2.schedules.wsd"


def test_checker_reports_a_bare_top_level_import(tree_copy):
    f = tree_copy / "optim" / "muon.py"
    f.write_text(f.read_text() + "\nimport model.build  # planted\n")
    assert [(v.kind, v.target) for v in check(tree_copy, DIRS)] == [("bare", "model.build")]


def test_no_bare_top_level_imports_in_tests_and_scripts():
    bare = ("config", "parallel", "model", "schedules", "optim", "launcher")
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n.split(".")[0] in bare]
    assert not bad, bad


def test_no_product_module_past_500_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in modules(REPO, DIRS).values()
        if (n := len(p.read_text().splitlines())) > 520
    }
    assert not long, long


def test_no_product_function_past_80_lines():
    """Functions (and methods) of the product, docstring included, at most 80 lines each."""
    long = {}
    for path in modules(REPO, DIRS).values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > 80:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert not long, long


def test_pyproject_installs_every_package_folder():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    listed = set(data["tool"]["setuptools"]["packages"])
    found = {m for m, p in modules(REPO, DIRS).items() if p.name == "__init__.py"}
    assert found == listed, (
        f"in pyproject.toml's packages but not a folder: {listed - found}; "
        f"a package folder pyproject.toml does not install: {found - listed}"
    )
    assert all(p.startswith("k2.") for p in listed)
