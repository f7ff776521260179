"""The test suite's wall time as CI sees it: ``.ci/run`` in fresh clones of this checkout's HEAD, one after
another, written to ``benchmarks/results/suite_time_<cpu>_<UTC time>.json`` by this script.

Usage: ``.venv/bin/python benchmarks/suite_time.py [--runs 3] [--budget-s 720] [--keep]`` (as root, as CI:
``.ci/run`` lets the Slurm tests install and start Slurm)

Each run clones the committed HEAD (``git clone``: what CI gets, no uncommitted change), runs ``.ci/run``
in the clone (it creates the clone's ``.venv``, runs every test on 4 xdist workers, then ruff and mypy) and
records: the wall time of ``.ci/run`` and of pytest alone (pytest's own summary line), the tests passed,
failed and skipped, the CPU seconds of ``.ci/run`` and what it waited for (``RUSAGE_CHILDREN``: the Slurm
tests' ranks are slurmd's children, not counted), the load average before the run, and a yardstick of the
host's speed that day: the wall time of one unchanged 80-step one-rank training test
(:data:`YARDSTICK`, from pytest's ``--durations`` list), because the same shared 2-core host has run the
same code 1.5-2x slower on some days (docs/results.md). The budget (``--budget-s``, default 720 s: the
project's 12 minutes) is judged on pytest's time, and the goal holds when at least two of three runs (a
majority of ``--runs``) are under it with every test passed.

The results file is rewritten after every run (atomically, :func:`k2.launcher.benchmarks.results.write_results`),
so an interrupted series keeps the runs it finished. Each clone is removed after its run unless ``--keep``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the test whose duration measures the host's speed: 80 steps of k2_tiny on one rank (89 s to 334 s on the
#: same "Intel(R) Xeon(R) Processor" host name); its file's git blob is recorded, since two series compare
#: only while the test is unchanged
YARDSTICK = "test_expert_balance.py::test_k2_tiny_experts_leave_the_warmup_collapse"
YARDSTICK_FILE = "tests/integration/test_expert_balance.py"
#: pytest's last line: "==== 1 failed, 1070 passed, 1 skipped, 405 warnings in 602.40s (0:10:02) ===="
#: a line of pytest's --durations list: "89.40s call     tests/integration/test_expert_balance.py::test_..."
_DURATION = re.compile(r"^(?P<secs>[0-9.]+)s (?P<phase>call|setup|teardown) +(?P<test>\S+)$")
_SUMMARY = re.compile(r"^=+ (?P<counts>.*?) in (?P<secs>[0-9.]+)s(?: \([0-9:]+\))? =+$", re.M)


def parse_log(text: str) -> dict:
    """Pytest's counts and time and the yardstick's duration from a ``.ci/run`` log (None where absent)."""
    out: dict = {"pytest_s": None, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "yardstick_s": None}
    found = _SUMMARY.findall(text)
    if found:
        counts, secs = found[-1]
        out["pytest_s"] = float(secs)
        for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", counts):
            out["errors" if word.startswith("error") else word] = int(n)
    slowest = []
    for line in text.splitlines():
        m = _DURATION.match(line)
        if m:
            slowest.append([float(m["secs"]), m["phase"], m["test"]])
            if YARDSTICK in line and m["phase"] == "call":
                out["yardstick_s"] = float(m["secs"])
    out["slowest"] = slowest  # pytest's --durations list: [seconds, phase, test]
    out["failed_tests"] = re.findall(r"^FAILED (\S+)", text, re.M)
    return out


def one_run(index: int, keep: bool) -> dict:
    """Clone HEAD, run ``.ci/run`` there, and return the run's figures."""
    clone = Path(tempfile.mkdtemp(prefix=f"k2-suite-time-{index}-"))  # (git clones into an empty directory)
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=clone, capture_output=True, text=True).stdout.strip()

    head, yardstick_blob = git("rev-parse", "HEAD"), git("rev-parse", f"HEAD:{YARDSTICK_FILE}")
    load = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run([str(clone / ".ci" / "run")], cwd=clone, capture_output=True, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    log = proc.stdout + proc.stderr
    figures = {
        "run": index,
        "head": head,
        "yardstick_blob": yardstick_blob,
        "ci_rc": proc.returncode,
        "ci_wall_s": round(wall, 1),
        "ci_cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
        "load_before": [round(x, 2) for x in load],
        **parse_log(log),
    }
    if proc.returncode != 0:
        figures["log_tail"] = log[-4000:]
    if not keep:
        shutil.rmtree(clone, ignore_errors=True)
    else:
        figures["clone"] = str(clone)
    return figures


def summarise(runs: list[dict], budget_s: float) -> dict:
    """How many runs passed every test under the budget, and whether that is a majority."""
    ok = [r for r in runs if r["ci_rc"] == 0 and r["pytest_s"] is not None and r["pytest_s"] < budget_s]
    return {
        "budget_s": budget_s,
        "pytest_s": [r["pytest_s"] for r in runs],
        "yardstick_s": [r["yardstick_s"] for r in runs],
        "runs_passing_under_budget": len(ok),
        "goal_holds": len(ok) * 2 > len(runs),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh clones to run, one after another (default 3)")
    ap.add_argument("--budget-s", type=float, default=720.0, help="pytest's budget in seconds (default 720)")
    ap.add_argument("--keep", action="store_true", help="keep each clone (default: removed after its run)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    from k2.launcher.benchmarks.results import results_record, write_results

    started = datetime.datetime.now(datetime.UTC)
    runs: list[dict] = []
    path = None
    for i in range(1, args.runs + 1):
        print(f"suite_time: run {i}/{args.runs}: .ci/run in a fresh clone of {REPO}", flush=True)
        runs.append(one_run(i, args.keep))
        r = runs[-1]
        print(
            f"suite_time: run {i}: .ci/run {r['ci_wall_s']:.0f} s (exit {r['ci_rc']}), pytest {r['pytest_s']} s, "
            f"{r['passed']} passed, {r['failed']} failed; yardstick {r['yardstick_s']} s",
            flush=True,
        )
        record = results_record("suite_time", vars(args), {"runs": runs, **summarise(runs, args.budget_s)}, now=started)
        path = write_results(record)  # (the same name each time: replaced with one more run)
    summary = summarise(runs, args.budget_s)
    print(f"suite_time: {summary}; results: {path}", flush=True)
    return 0 if summary["goal_holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
