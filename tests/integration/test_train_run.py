"""The trainer's outputs: metrics.jsonl complete per step, validation on schedule, the config saved,
wandb offline without network; and the one-command spawn path of ``k2-train``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import REPO
from support.distributed import run_trainer, trainer_env

pytestmark = pytest.mark.slow

REQUIRED = {"step", "consumed_tokens", "lr", "loss", "grad_norm", "tokens_per_s", "phase", "seq_length"}


def test_metrics_jsonl_is_complete(tmp_path, stdlib_corpus):
    run_dir = tmp_path / "run"
    recs = run_trainer(["train.iters=4", "train.eval_interval=2", "train.eval_iters=1",
                        "schedule.global_batch_tokens=1024"], 1, run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    tokens_per_step = 8 * 128  # 8 sequences of tiny_wsd's first context length
    for r in recs:
        assert REQUIRED <= set(r), r
        assert r["consumed_tokens"] == r["step"] * tokens_per_step
        assert (r["phase"], r["seq_length"]) == ("warmup", 128)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
        assert ("val_loss" in r) == (r["step"] % 2 == 0)
        assert 0 < r["moe_load_max_over_mean"] and r["max_attn_logit"] > 0
    assert (run_dir / "config.yaml").read_text().count("k2_tiny") >= 1


def test_k2_train_spawns_its_own_ranks_with_wandb_offline(tmp_path, stdlib_corpus):
    """``k2-train parallel=pp2`` (no torchrun around it) starts 2 ranks itself; wandb runs offline."""
    run_dir = tmp_path / "run"
    env = trainer_env({"WANDB_MODE": "offline"})
    p = subprocess.run(
        [sys.executable, "-m", "k2.launcher.train", "parallel=pp2", "train.iters=2", "train.eval_interval=0",
         "train.progress=false", f"run.dir={run_dir}", "run.wandb.mode=offline",
         f"launch.master_port={29700 + os.getpid() % 200}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "spawning 2 local ranks" in p.stdout
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert any((run_dir / "wandb").glob("offline-run-*")), list(run_dir.iterdir())


def test_divergence_stops_with_step_lr_and_last_checkpoint(tmp_path, stdlib_corpus):
    """An LR of 1e20 from step 1: step 1 is finite and saved, step 2's loss / gradient norm are not; the
    run exits with DIVERGED_EXIT after one line naming step 2, its LR and the step-1 checkpoint, and saves
    nothing of step 2."""
    from k2.launcher.cli import DIVERGED_EXIT

    run_dir = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "k2.launcher.train", "train.iters=4", "train.save_interval=1",
         "train.eval_interval=0", "schedule.phases.0.steps=0", "schedule.phases.1.lr_start=1e20",
         "schedule.global_batch_tokens=1024", "train.progress=false", "run.wandb.mode=disabled",
         f"run.dir={run_dir}"],
        cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == DIVERGED_EXIT, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    lines = [x for x in p.stderr.splitlines() if x.startswith("k2-train: error:")]
    assert len(lines) == 1, p.stderr[-4000:]
    ck = run_dir / "checkpoints" / "iter_0000001"
    assert "training diverged at step 2 (lr 1e+20)" in lines[0] and f"last checkpoint is {ck}" in lines[0]
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
    assert sorted(x.name for x in (run_dir / "checkpoints").iterdir()) == ["iter_0000001", "latest"]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1]
