"""The trainer's outputs: metrics.jsonl complete per step, validation on schedule, the config saved,
wandb offline without network; and the one-command spawn path of ``k2-train``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import REPO
from support.distributed import SUPPORT, rank_launch_cmd, run_trainer, trainer_env

pytestmark = pytest.mark.slow

REQUIRED = {"step", "consumed_tokens", "lr", "loss", "grad_norm", "tokens_per_s", "phase", "seq_length"}


def test_metrics_jsonl_is_complete(tmp_path, stdlib_corpus):
    """One record per step, the validation loss before training as a step-0 record, and the end-of-run
    summary (steps, tokens, wall time, final val loss, where the outputs are) on rank 0's stdout."""
    run_dir = tmp_path / "run"
    out = tmp_path / "stdout.txt"
    recs = run_trainer(
        [
            "train.iters=4",
            "train.eval_interval=2",
            "train.eval_iters=1",
            "schedule.global_batch_tokens=1024",
            "train.report=true",
        ],
        1,
        run_dir,
        stdout_to=out,
    )
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first.keys() == {"step", "consumed_tokens", "phase", "seq_length", "val_loss"}, first
    assert (first["step"], first["consumed_tokens"], first["seq_length"]) == (0, 0, 128)
    assert 7.5 < first["val_loss"] < 9  # ~ln 4096 = 8.32 at init
    text = out.read_text()
    # the optimizer of every parameter: one line at the start, the table in a file
    opt = [x for x in text.splitlines() if x.startswith("optimizer adamw")]
    assert opt == [
        f"optimizer adamw (qk_clip_tau=None): elements: adamw {opt[0].split('adamw ')[-1].split(';')[0]}; "
        f"per parameter: {run_dir / 'optimizer_params.txt'}"
    ], text[:3000]
    assert "orthogonalised" not in text and "orthogonalised" in (run_dir / "optimizer_params.txt").read_text()
    summary = text[text.index("k2-train: done: ") :]
    assert "4 steps run (1..4) of 4, 4,096 tokens in total" in summary and "s wall time" in summary
    assert f"final val_loss {recs[-1]['val_loss']:.4f}" in summary
    for where in (run_dir / "metrics.jsonl", run_dir / "checkpoints", "latest: iter_0000004", "wandb:"):
        assert str(where) in summary, summary
    tokens_per_step = 8 * 128  # 8 sequences of tiny_wsd's first context length
    for r in recs:
        assert REQUIRED <= set(r), r
        assert r["consumed_tokens"] == r["step"] * tokens_per_step
        assert (r["phase"], r["seq_length"]) == ("warmup", 128)
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0
        assert ("val_loss" in r) == (r["step"] % 2 == 0)
        assert 0 < r["moe_load_max_over_mean"] and r["max_attn_logit"] > 0
    assert (run_dir / "config.yaml").read_text().count("k2_tiny") >= 1
    # on CPU without cluster.cpu_peak_tflops there is no peak to measure MFU against (not a GPU's)
    assert all(r["mfu"] is None and r["model_tflops_per_gpu"] > 0 for r in recs)
    # train.report=true: the report's summary after the run's, and its PNGs
    report = text[text.index("k2-report: ") :]
    assert " ".join(report.split()).count("steps 4 (4,096 tokens)") == 1 and "MFU" in report, report
    assert "none (a CPU run" in report, report
    assert sorted(p.name for p in (run_dir / "report").iterdir()) == [
        "grad_norm.png",
        "loss.png",
        "lr.png",
        "max_logit.png",
        "moe_balance.png",
        "throughput.png",
    ]


def test_k2_train_spawns_its_own_ranks_with_wandb_offline(tmp_path, stdlib_corpus):
    """``k2-train parallel=pp2`` (no torchrun around it) starts 2 ranks itself; wandb runs offline; the
    summary names the wandb dir. The config is composed and the run planned once, by ``k2-train``: its
    ranks train with what it handed them (tests/support/call_log logs every call of ``load_config`` and
    ``prepare_run`` in every process of the run). The same command again, on the finished run, is
    "nothing to do": exit 0, no rank started, metrics.jsonl untouched."""
    run_dir = tmp_path / "run"
    calls = tmp_path / "calls.log"
    env = trainer_env(
        {
            "WANDB_MODE": "offline",
            "K2_TEST_CALL_LOG": str(calls),
            "PYTHONPATH": os.pathsep.join([str(SUPPORT / "call_log"), *filter(None, [os.environ.get("PYTHONPATH")])]),
        }
    )
    cmd = [
        sys.executable,
        "-m",
        "k2.launcher.train",
        "parallel=pp2",
        "train.iters=2",
        "train.eval_interval=0",
        "train.progress=false",
        f"run.dir={run_dir}",
        "run.wandb.mode=offline",
        f"launch.master_port={29700 + os.getpid() % 200}",
    ]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "spawning 2 local ranks" in p.stdout
    assert f"wandb:       {run_dir / 'wandb'}" in p.stdout, p.stdout[-2000:]
    metrics = (run_dir / "metrics.jsonl").read_text()
    recs = [json.loads(x) for x in metrics.splitlines()]
    assert [r["step"] for r in recs] == [1, 2]
    assert any((run_dir / "wandb").glob("offline-run-*")), list(run_dir.iterdir())
    logged = [line.split() for line in calls.read_text().splitlines()]
    assert [name for _, name in logged] == ["load_config", "prepare_run"], logged  # not once more per rank
    assert len({pid for pid, _ in logged}) == 1, logged  # both in k2-train itself

    # (forked by the session's fork server: the same k2-train, without a fresh interpreter's imports)
    again = subprocess.run(
        rank_launch_cmd(1, cmd[1:3], cmd[3:]), cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert "is at step 2, the run ends at step 2" in again.stdout and "nothing to do" in again.stdout
    assert "spawning" not in again.stdout and (run_dir / "metrics.jsonl").read_text() == metrics


def test_divergence_stops_with_step_lr_and_last_checkpoint_then_resumes_quietly(tmp_path, stdlib_corpus):
    """Step 1 half-way up the warmup, step 2 at its peak, 1e20: steps 1-2 are finite and saved, step 3's
    loss / gradient norm are not; the run exits with DIVERGED_EXIT after one line naming step 3, its LR
    and the step-2 checkpoint, and saves nothing of step 3. A run resuming from the step-1 checkpoint
    (another run dir, one step) prints no library warning (torch's dist-checkpoint notices, megatron's
    rerun-machine line)."""
    from k2.launcher.cli import DIVERGED_EXIT

    run_dir = tmp_path / "run"
    common = [
        sys.executable,
        "-m",
        "k2.launcher.train",
        "train.iters=4",
        "train.save_interval=1",
        "train.eval_interval=0",
        "schedule.phases.0.steps=2",
        "schedule.phases.1.lr_start=1e20",
        "schedule.global_batch_tokens=1024",
        "train.progress=false",
        "run.wandb.mode=disabled",
    ]
    # (the diverging run is forked by the session's fork server: the same k2-train process, without
    # another ~10 s import; the resumed run below is a fresh interpreter, whose start-up must be quiet)
    p = subprocess.run(
        rank_launch_cmd(1, common[1:3], [*common[3:], f"run.dir={run_dir}"]),
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == DIVERGED_EXIT, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])
    lines = [x for x in p.stderr.splitlines() if x.startswith("k2-train: error:")]
    assert len(lines) == 1, p.stderr[-4000:]
    ck = run_dir / "checkpoints" / "iter_0000002"
    assert "training diverged at step 3 (lr 1e+20)" in lines[0] and f"last checkpoint is {ck}" in lines[0]
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
    assert sorted(x.name for x in (run_dir / "checkpoints").iterdir()) == ["iter_0000001", "iter_0000002", "latest"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2]

    ck1 = run_dir / "checkpoints" / "iter_0000001"
    again = subprocess.run(
        [
            *common,
            "train.iters=2",
            "train.save_interval=null",
            "checkpoint.save_at_end=false",
            f"resume.from={ck1}",
            f"run.dir={tmp_path / 'again'}",
        ],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resumed from {ck1} (step 1" in again.stdout
    warnings = [x for x in again.stderr.splitlines() if "warn" in x.lower()]
    assert not warnings, again.stderr[-4000:]
