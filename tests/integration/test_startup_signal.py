"""A preemption notice (SIGUSR1, what Slurm's ``--signal=USR1@N`` sends) that arrives before the process
groups exist: the handlers are installed first (docs/checkpoints.md), so the run is not killed
by the signal's default action; it trains its first step, saves it, and exits 42."""

from __future__ import annotations

import json
import subprocess

import pytest

from support import REPO, SCRIPTS
from support.distributed import rank_launch_cmd, trainer_env

pytestmark = pytest.mark.slow


def test_sigusr1_before_the_process_groups_saves_step_one_and_exits_42(tmp_path, stdlib_corpus):
    run_dir = tmp_path / "run"
    args = [
        "train.iters=5",
        "train.eval_interval=0",
        "train.progress=false",
        "run.wandb.mode=disabled",
        f"run.dir={run_dir}",
    ]
    p = subprocess.run(
        rank_launch_cmd(1, [str(SCRIPTS / "fault_train.py")], args),
        cwd=REPO,
        env=trainer_env({"K2_FAULT": "sigusr1_before_pg:0:0"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 42, p.stdout[-3000:] + p.stderr[-3000:]
    assert "SIGUSR1 received during start-up" in p.stdout, p.stdout[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s > 0] == [1], steps
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000001"
    state = json.loads((run_dir / "checkpoints" / "iter_0000001" / "k2_state.json").read_text())
    assert state["step"] == 1 and state["reason"] == "preempted: signal"
