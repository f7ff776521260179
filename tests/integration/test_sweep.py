"""The sparsity sweep end to end: one command runs every point, a re-run after a kill finishes only the
missing work, the report has the table, the FLOPs and the plot. (The sweep's ``k2-train -m`` processes are
forked by the session's fork server, tests/support/distributed.py ``rank_launch_cmd``: the imports a sweep
does once for all its points are done once per session; SIGTERM to the client reaches the sweep.)
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO
from support.distributed import rank_launch_cmd, trainer_env

# a short CPU version of recipes/experiment/sparsity_sweep.yaml: one rank, 8 steps of 4 sequences per point
SHORT = ["+experiment=sparsity_sweep", "parallel=single", "train.iters=8", "schedule.global_batch_tokens=512",
         "train.eval_interval=4", "train.eval_iters=1", "train.progress=false", "run.wandb.mode=disabled",
         "sweep.val_loss_target=8.25"]


def _sweep_cmd(args) -> list[str]:
    """``k2-train -m ARGS`` (a sweep) as one launch of the fork server."""
    return rank_launch_cmd(1, ["-m", "k2.launcher.train"], ["-m", *args])


def _sweep(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(_sweep_cmd(args), cwd=REPO, env=trainer_env(), capture_output=True, text=True,
                          timeout=900, **kw)


def _steps(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl, the evaluation before training (step 0) included."""
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sweep_runs_resumes_after_kill_and_reports(tmp_path, stdlib_corpus):
    sweep_dir = tmp_path / "sweep"
    args = [*SHORT, f"sweep.dir={sweep_dir}"]
    p = subprocess.Popen(_sweep_cmd(args), cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    second = sweep_dir / "sparsity_4" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and p.poll() is None and not (second.exists() and second.read_text().count("\n") >= 3):
        time.sleep(0.3)
    p.send_signal(signal.SIGTERM)  # kill the sweep half-way: during point 2
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 42, out[-3000:]
    first = sweep_dir / "sparsity_2"
    assert _steps(first) == list(range(0, 9))  # step 0: the validation loss before training
    done_first = (first / "metrics.jsonl").read_text()
    assert not (sweep_dir / "sparsity_8").exists()

    again = _sweep(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "sparsity_2 (E=4): finished" in again.stdout and "sparsity_4 (E=8): partial" in again.stdout
    assert (first / "metrics.jsonl").read_text() == done_first  # not re-run
    for s in (2, 4, 8):
        assert _steps(sweep_dir / f"sparsity_{s}") == list(range(0, 9))

    rep = subprocess.run([sys.executable, "-c", "from k2.launcher.sweep_report import cli; cli()",
                          str(sweep_dir)], cwd=REPO, env=trainer_env(), capture_output=True, text=True,
                         timeout=300)
    assert rep.returncode == 0, rep.stderr
    rows = list(csv.DictReader(open(sweep_dir / "sweep.csv")))
    assert [int(r["sparsity"]) for r in rows] == [2, 4, 8]
    assert [int(r["experts"]) for r in rows] == [4, 8, 16]
    assert len({r["tokens"] for r in rows}) == 1  # equal token budget
    assert all(r["final_val_loss"] for r in rows)
    assert (sweep_dir / "sweep.png").stat().st_size > 10_000 and (sweep_dir / "sweep.md").exists()
    assert "fewer FLOPs than sparsity 2" in rep.stdout or "not comparable" in rep.stdout
