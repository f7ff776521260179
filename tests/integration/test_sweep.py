"""The sparsity sweep's grid end to end on one machine: trunks and cooldown branches, exact.

One 2-arm x 2-budget grid (dense and sparsity 4 at top-2, one seed) is trained by ``k2-train -m`` (two runs
at a time); then:

* a branch's records up to its branch point are the trunk's, byte for byte, and its LR follows the 1-sqrt
  cooldown to zero at its budget;
* a branch equals a run of its schedule from scratch, loss for loss (the trunk + branch split is exact);
* a branch killed with SIGKILL mid-way resumes from its own checkpoint and ends with the same losses;
* a second run of the finished command trains nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from k2.launcher.tools.sweep import TEST_PYTHON_ENV
from support import REPO
from support.distributed import fork_server_python, rank_launch_cmd, trainer_env

pytestmark = pytest.mark.slow

B = 2048  # tokens per step
# recipes/experiment/sparsity_sweep.yaml made short: steps of 8 x 256 tokens, budgets of 10 and 20 steps
# (branch points 8 and 16), the session's corpus (vocabulary 4,096)
SHORT = [
    "+experiment=sparsity_sweep",
    "sweep.sparsities=[1,4]",
    "sweep.seeds=[1]",
    "sweep.budgets_tokens=[20480,40960]",
    f"schedule.global_batch_tokens={B}",
    "train.micro_batch_size=2",
    "schedule.phases.0.steps=2",
    "train.eval_interval=4",
    "train.eval_iters=1",
    "train.save_interval=5",
    "train.progress=false",
    "run.wandb.mode=disabled",
    "model.vocab_size=4096",
    "data.vocab_size=4096",
]
CELL = Path("sparsity_4/seed_1/budget_40960")


def _sweep(args, forked_runs: Path | None = None) -> subprocess.CompletedProcess:
    """``k2-train -m args``; with ``forked_runs`` (a directory for the wrapper) each of its runs is forked by
    the session's fork server instead of a fresh interpreter (the sweep's test seam): the runs are the same
    ``k2-train`` processes, without ~5 CPU-s of imports each."""
    cmd = rank_launch_cmd(1, ["-m", "k2.launcher.train"], ["-m", *args])
    env = trainer_env({TEST_PYTHON_ENV: fork_server_python(forked_runs)} if forked_runs else None)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> dict[int, tuple]:
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in _records(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def grid(tmp_path_factory, stdlib_corpus):
    sweep_dir = tmp_path_factory.mktemp("sweep")
    done = _sweep([*SHORT, f"sweep.dir={sweep_dir}"], forked_runs=tmp_path_factory.mktemp("python"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return sweep_dir, done


def test_a_branch_starts_as_its_trunk_and_cools_down_to_its_budget(grid):
    sweep_dir, done = grid
    assert "all 4 cells finished" in done.stdout
    manifest = json.loads((sweep_dir / "grid.json").read_text())
    assert sorted(c["cell"] for c in manifest["cells"]) == sorted(
        f"sparsity_{s}/seed_1/budget_{b}" for s in (1, 4) for b in (20480, 40960)
    )
    for c in manifest["cells"]:
        trunk, cell = sweep_dir / c["trunk_dir"], sweep_dir / c["run_dir"]
        step = c["branch_step"]
        assert step == {20480: 8, 40960: 16}[c["budget_tokens"]]
        assert (trunk / "checkpoints" / f"iter_{step:07d}").is_dir()  # the trunk kept every branch point
        trunk_lines = [x for x in (trunk / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] <= step]
        cell_lines = (cell / "metrics.jsonl").read_text().splitlines()
        assert cell_lines[: len(trunk_lines)] == trunk_lines  # the same bytes
        assert [json.loads(x)["step"] for x in cell_lines] == list(range(0, c["last_step"] + 1))
        assert json.loads((cell / "branch.json").read_text())["trunk_step"] == step
        info = json.loads((cell / "cell.json").read_text())
        assert info["status"] == "finished" and info["tokens"] == c["budget_tokens"]
        assert info["final_val_loss"] == _records(cell)[-1]["val_loss"]
        last = c["last_step"]
        for r in _records(cell)[step + 1 :]:  # 1-sqrt from the constant LR to 0 at the budget
            ratio = (r["step"] - step) / (last - step)
            assert r["lr"] == pytest.approx(3.0e-3 * (1 - math.sqrt(ratio)), rel=1e-9, abs=1e-15), r["step"]
        assert _records(cell)[-1]["lr"] == 0.0


def test_a_branch_is_the_run_of_its_schedule_from_scratch(grid, tmp_path):
    sweep_dir, _ = grid
    cell = sweep_dir / CELL
    cfg = (cell / "k2-train.log").read_text()  # (written by the sweep: the run is an ordinary k2-train)
    assert "branched from" in cfg
    from k2.launcher.tools.sweep_grid import build_grid

    _, g = build_grid([*SHORT, f"sweep.dir={sweep_dir}"])
    ovr = next(c.overrides for c in g.cells if c.run_dir == cell)
    straight = [o for o in ovr if not o.startswith(("resume.branch_from=", "run.dir="))]
    run = subprocess.run(
        rank_launch_cmd(1, ["-m", "k2.launcher.train"], [*straight, f"run.dir={tmp_path / 's'}"]),
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert _losses(tmp_path / "s") == _losses(cell)  # every step: loss, gradient norm, LR


def test_a_branch_killed_midway_resumes_bitwise_and_a_second_run_trains_nothing(grid, tmp_path):
    sweep_dir, _ = grid
    mine = tmp_path / "sweep"
    # saves at steps 18 and 20, each committed before the next step starts
    args = [*SHORT, "sweep.sparsities=[4]", "train.save_interval=2", "checkpoint.async_save=false", f"sweep.dir={mine}"]
    # the arm's finished trunk (a checkpoint at each branch point) and shorter cell, copied from the grid:
    # the sweep trains only CELL's branch (a trunk counts as finished by its branch-point checkpoints)
    for run in (CELL.parent / "trunk", CELL.parent / "budget_20480"):
        shutil.copytree(sweep_dir / run, mine / run)
    p = subprocess.Popen(
        rank_launch_cmd(1, ["-m", "k2.launcher.train"], ["-m", *args]),
        cwd=REPO,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    saved = mine / CELL / "checkpoints" / "iter_0000018"
    deadline = time.time() + 600
    while time.time() < deadline and not saved.is_dir():
        assert p.poll() is None, p.communicate()[0][-3000:]
        time.sleep(0.05)
    # kill -9 the branch (its checkpoint at step 18 exists, not yet its last) and the sweep
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(mine / CELL) in a for a in (proc.info["cmdline"] or [])):
            os.killpg(proc.pid, signal.SIGKILL) if proc.pid == os.getpgid(proc.pid) else proc.kill()
    p.kill()
    p.communicate(timeout=60)
    assert not (mine / CELL / "checkpoints" / "iter_0000020").exists(), "killed after its last step: retry"
    assert not (mine / CELL / "cell.json").exists()
    again = _sweep(args, forked_runs=tmp_path)  # (the run killed above was a process of its own)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "1 partial" in again.stdout and "1 to train" in again.stdout, again.stdout
    assert _losses(mine / CELL) == _losses(sweep_dir / CELL)  # resumed from its own step 18, bit for bit
    third = _sweep(args)
    assert third.returncode == 0 and "0 to train" in third.stdout, third.stdout
