"""The lint's complexity rule (pyproject.toml ``[tool.ruff.lint.mccabe]``) is on and is a ratchet: it
refuses a function more branched than the limit, and the limit is the repository's worst function today,
so a change can only keep or lower it (lower the limit when that function is split)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from support import REPO

LIMIT = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["mccabe"]["max-complexity"]


def _ruff(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_function_past_the_limit_is_refused(tmp_path):
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(LIMIT))  # complexity LIMIT + 1
    (tmp_path / "branched.py").write_text(f"def branched(x):\n{branches}\n    return -1\n")
    out = _ruff("--config", str(REPO / "pyproject.toml"), str(tmp_path / "branched.py"))
    assert out.returncode == 1 and "C901" in out.stdout, out.stdout + out.stderr


def test_the_limit_is_todays_worst_function():
    at_limit = _ruff("--select", "C901", "--config", f"lint.mccabe.max-complexity={LIMIT - 1}", ".")
    assert f"({LIMIT} > {LIMIT - 1})" in at_limit.stdout, (
        f"no function has complexity {LIMIT} any more: lower [tool.ruff.lint.mccabe] max-complexity\n" + at_limit.stdout
    )
