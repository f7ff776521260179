"""Sparsity sweep (issue 9): one command runs every point, a re-run finishes only the missing work, the
report compares FLOPs to a validation-loss target; bad sweeps are refused before anything runs."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from distributed import trainer_env

# a short CPU version of recipes/experiment/sparsity_sweep.yaml: one rank, 8 steps per point
SHORT = ["+experiment=sparsity_sweep", "parallel=single", "train.iters=8", "train.eval_interval=4",
         "train.eval_iters=1", "train.save_interval=2", "train.progress=false", "run.wandb.mode=disabled",
         "sweep.val_loss_target=8.25"]


def _sweep(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.train", "-m", *args], cwd=REPO,
                          env=trainer_env(), capture_output=True, text=True, timeout=900, **kw)


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_points_derive_experts_and_keep_gemm_flops_equal():
    from launcher.config import load_config
    from launcher.sweep import gemm_flops_per_token, sweep_points
    from model.flops import flops_per_token
    from model.params import count_params

    cfg, points = sweep_points(["+experiment=sparsity_sweep", "sweep.sparsities=[2,4,8]"])
    assert [(p.sparsity, p.experts) for p in points] == [(2, 4), (4, 8), (8, 16)]
    assert len({p.run_dir for p in points}) == 3
    cfgs = [load_config(list(p.overrides)) for p in points]
    for c in cfgs:  # only the expert count differs from the base
        assert c.model.moe_ffn_hidden_size == cfg.model.moe_ffn_hidden_size
        assert c.model.moe_shared_expert_intermediate_size == cfg.model.moe_shared_expert_intermediate_size
        assert c.run.wandb.group == "sparsity_sweep"
    # activated parameters and GEMM FLOPs per token equal; total parameters and the router grow with E
    params = [count_params(c) for c in cfgs]
    assert len({p.active - p.router * p.moe_pattern.count(1) for p in params}) == 1, [p.as_dict() for p in params]
    assert params[0].total < params[1].total < params[2].total
    assert len({gemm_flops_per_token(c.model, 128) for c in cfgs}) == 1
    routers = [flops_per_token(c.model, 128).terms()["router"] for c in cfgs]
    assert routers[0] < routers[1] < routers[2]


@pytest.mark.parametrize("bad,named", [
    (["model.moe_router_topk=3", "sweep.sparsities=[1,2]"], "sparsity=1 (model.num_moe_experts=3"),  # EP=2
    (["sweep.sparsities=[2,2]"], "sweep.sparsities"),
    (["sweep.sparsities=[]"], "sweep.sparsities"),
])
def test_bad_sweep_is_refused_before_anything_runs(tmp_path, no_process_start, capsys, bad, named):
    from launcher.train import main

    rc = main(["-m", "+experiment=sparsity_sweep", f"sweep.dir={tmp_path / 'sweep'}", *bad])
    err = capsys.readouterr().err
    assert rc == 2 and named in err and err.count("\n") == 1, err
    assert no_process_start == [] and not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_sweep_runs_resumes_after_kill_and_reports(tmp_path, stdlib_corpus):
    sweep_dir = tmp_path / "sweep"
    args = [*SHORT, f"sweep.dir={sweep_dir}"]
    p = subprocess.Popen([sys.executable, "-m", "launcher.train", "-m", *args], cwd=REPO,
                         env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = sweep_dir / "sparsity_4" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and p.poll() is None and not (second.exists() and second.read_text().count("\n") >= 3):
        time.sleep(0.3)
    p.send_signal(signal.SIGTERM)  # kill the sweep half-way: during point 2
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 42, out[-3000:]
    first = sweep_dir / "sparsity_2"
    assert _steps(first) == list(range(1, 9))
    done_first = (first / "metrics.jsonl").read_text()
    assert not (sweep_dir / "sparsity_8").exists()

    again = _sweep(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "sparsity_2 (E=4): finished" in again.stdout and "sparsity_4 (E=8): partial" in again.stdout
    assert (first / "metrics.jsonl").read_text() == done_first  # not re-run
    for s in (2, 4, 8):
        assert _steps(sweep_dir / f"sparsity_{s}") == list(range(1, 9))

    rep = subprocess.run([sys.executable, "-c", "from launcher.sweep import report_cli; report_cli()",
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
