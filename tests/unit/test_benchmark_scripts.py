"""The GPU scripts in benchmarks/ (run only where a GPU is lent, so a typo costs a device session): bash
parses them, and every file test they make names what exists in the checkout as that kind (a ``-f`` on a
directory is always false: the step it guards never runs)."""

from __future__ import annotations

import re
import subprocess

import pytest

from support import REPO

SCRIPTS = sorted((REPO / "benchmarks").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_gpu_script_parses_and_tests_files_as_what_they_are(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    for flag, path in re.findall(r"\[ -([fd]) ([^\]$\"\s]+) \]", script.read_text()):
        target = REPO / path
        if target.exists():
            assert target.is_dir() == (flag == "d"), f"{script.name}: [ -{flag} {path} ]"
