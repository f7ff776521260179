"""The import direction of k2-launcher, checked from the source (ast): every import points down the
layers of ``k2.config``'s docstring, siblings of one layer do not import each other, and no module
imports itself back through a chain (a cycle). In-function imports count like module-level ones.

:func:`check` takes a source tree and the folder -> package mapping (pyproject.toml's ``package-dir``),
so the tests can also run it on a small tree with a planted upward import and a planted cycle.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

#: the layers, bottom first; a unit is a package prefix (a module belongs to its longest matching unit)
LAYERS: list[list[str]] = [
    ["k2.config"],
    ["k2.parallel"],
    ["k2.model"],
    ["k2.schedules"],
    ["k2.optim"],
    ["k2.launcher.quiet", "k2.launcher.gc_pause", "k2.launcher.progress", "k2.launcher.checksums"],
    ["k2.launcher.datasets", "k2.launcher.checkpointing", "k2.launcher.planning"],
    ["k2.launcher.hf"],
    ["k2.launcher.training"],
    ["k2.launcher.benchmarks", "k2.launcher.tools"],
    ["k2.launcher.cli"],
    [
        "k2.launcher.train",
        "k2.launcher.plan",
        "k2.launcher.data",
        "k2.launcher.bench",
        "k2.launcher.submit",
        "k2.launcher.sweep_report",
        "k2.launcher.convert",
        "k2.launcher.report",
        "k2.launcher",
    ],
]
#: the repository's top-level folders that are packages; importing them by their bare name is an error
#: (an installed wheel has only ``k2.<name>``)
BARE = ("config", "parallel", "model", "schedules", "optim", "launcher", "recipes")


@dataclass(frozen=True)
class Violation:
    """One import against the rules: ``kind`` is ``upward``, ``sibling``, ``cycle`` or ``bare``."""

    kind: str
    module: str
    target: str
    where: str  # file:line

    def __str__(self) -> str:
        if self.kind == "cycle":  # module: the modules of the cycle, "a -> b"; target: where it closes
            return f"{self.where}: import cycle {self.module} -> {self.target}"
        return f"{self.where}: {self.kind} import of {self.target} by {self.module}"


def package_dirs(pyproject: Path) -> dict[str, str]:
    """pyproject.toml's ``[tool.setuptools] package-dir``: package -> folder (relative to the repo)."""
    data = tomllib.loads(pyproject.read_text())
    return dict(data["tool"]["setuptools"]["package-dir"])


def modules(root: Path, dirs: dict[str, str]) -> dict[str, Path]:
    """Every module of the mapped folders: dotted name -> file."""
    out = {}
    for package, folder in dirs.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def unit_of(module: str, layers: list[list[str]] = LAYERS) -> tuple[int, str] | None:
    """(layer index, unit) of ``module``: the longest unit that is the module or a package above it."""
    best = None
    for i, units in enumerate(layers):
        for u in units:
            if (module == u or module.startswith(u + ".")) and (best is None or len(u) > len(best[1])):
                best = (i, u)
    return best


def imports(path: Path, module: str, is_package: bool) -> list[tuple[str, int]]:
    """``(imported module, line)`` of every import statement in ``path`` (relative imports resolved;
    ``from X import name`` counts as an import of ``X.name`` when that is a module, else of ``X``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((mod, node.lineno))
            found += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return found


def check(root: Path, dirs: dict[str, str], layers: list[list[str]] = LAYERS) -> list[Violation]:
    """All violations in the tree at ``root`` (empty when the direction holds)."""
    mods = modules(root, dirs)
    out: list[Violation] = []
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_package = path.name == "__init__.py"
        for target, line in imports(path, mod, is_package):
            where = f"{path.relative_to(root)}:{line}"
            if target.split(".")[0] in BARE:
                out.append(Violation("bare", mod, target, where))
                continue
            if target not in mods or target == mod:
                continue
            graph[mod].add(target)
            a, b = unit_of(mod, layers), unit_of(target, layers)
            if a is None or b is None or a[1] == b[1]:
                continue
            if b[0] > a[0]:
                out.append(Violation("upward", mod, target, where))
            elif b[0] == a[0]:
                out.append(Violation("sibling", mod, target, where))
    out += [Violation("cycle", " -> ".join(c), c[0], str(mods[c[0]].relative_to(root))) for c in cycles(graph)]
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> modules it imports): one list per strongly connected
    component of more than one module (Tarjan's algorithm), in import order from its first member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
