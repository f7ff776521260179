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


def test_suite_time_reads_pytests_summary_and_judges_the_majority_of_runs():
    """benchmarks/suite_time.py: pytest's time and counts and the yardstick's duration from a ``.ci/run``
    log; the goal holds only when most runs pass every test under the budget."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_time", REPO / "benchmarks" / "suite_time.py")
    st = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(st)
    log = (
        f"89.40s call     tests/integration/{st.YARDSTICK}\n"
        "FAILED tests/unit/x.py::test_y - AssertionError\n"
        "==== 1 failed, 1070 passed, 1 skipped, 405 warnings in 602.40s (0:10:02) ====\n"
    )
    got = st.parse_log(log)
    assert (got["pytest_s"], got["passed"], got["failed"], got["skipped"]) == (602.4, 1070, 1, 1)
    assert got["yardstick_s"] == 89.4 and got["failed_tests"] == ["tests/unit/x.py::test_y"]
    assert got["slowest"] == [[89.4, "call", f"tests/integration/{st.YARDSTICK}"]]
    run = {"ci_rc": 0, "pytest_s": 600.0, "yardstick_s": 90.0}
    slow, failed = {**run, "pytest_s": 800.0}, {**run, "ci_rc": 1}
    assert st.summarise([run, slow, run], 720)["goal_holds"]
    assert not st.summarise([run, slow, failed], 720)["goal_holds"]
    assert st.summarise([run, slow, failed], 720)["runs_passing_under_budget"] == 1
