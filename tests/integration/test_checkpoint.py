"""Checkpoints, exact resume and preemption, on the production path (torchrun, gloo, megatron's
dist-checkpointing and distributed optimizer).

The reference is always an uninterrupted run with the same settings; "bitwise" means the per-step loss
and grad norm floats and the final parameters are equal, not close.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import REPO, SCRIPTS
from support.distributed import run_trainer, trainer_env

# MuonClip with a tau small enough that QK-Clip fires: the resumed state includes Muon's momentum in
# megatron's byte-range ZeRO-1 shards (EP and DP) and the Adam moments of the other parameters
# microbatches of 4 sequences: 2 per DP rank (interleaved 1F1B still runs), half the passes of the default
# (checkpoint, resume and signal behaviour do not depend on the microbatch count)
CPU4 = ["parallel=cpu4", "optim=muonclip", "optim.qk_clip_tau=0.1", "train.eval_interval=2", "train.eval_iters=1",
        "train.micro_batch_size=4"]


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def _state(run_dir: Path, name: str | None = None) -> dict:
    return json.loads((run_dir / "checkpoints" / (name or _latest(run_dir)) / "k2_state.json").read_text())


def _by_step(recs: list[dict]) -> dict:
    return {r["step"]: r for r in recs}


def _model_tensors(ckpt: Path, tmp_path: Path) -> dict:
    """All model tensors of a torch_dist checkpoint, read in this process (no process group) with
    torch.distributed.checkpoint's converter: an independent reader of what megatron wrote."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(out, weights_only=False)
    # the distributed optimizer's flat buffers hold uninitialised padding between parameters, so
    # only the model tensors are compared bitwise; the optimizer state shows in every later step
    return {k: v for k, v in sd.items() if torch.is_tensor(v) and "optimizer" not in k and "rng" not in k}


def _assert_same_steps(got: list[dict], ref: list[dict], steps) -> None:
    g, r = _by_step(got), _by_step(ref)
    for s in steps:
        assert (g[s]["loss"], g[s]["grad_norm"]) == (r[s]["loss"], r[s]["grad_norm"]), (s, g[s], r[s])
        assert g[s]["consumed_tokens"] == r[s]["consumed_tokens"] and g[s]["lr"] == r[s]["lr"]
        assert g[s].get("val_loss") == r[s].get("val_loss"), s


@pytest.fixture(scope="module")
def cpu4_reference(tmp_path_factory, stdlib_corpus):
    """cpu4 (PP2 VPP2 EP2 DP2, MuonClip), 8 steps straight, a checkpoint every 2 steps (all kept)."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    recs = run_trainer([*CPU4, "train.iters=8", "train.save_interval=2", "checkpoint.keep_last=8"], 4, run_dir)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert any(r["qk_clipped_heads"] for r in recs)  # QK-Clip fired, so its effect is resumed too
    return run_dir, recs


@pytest.mark.slow
def test_bitwise_resume_cpu4_once_and_twice(cpu4_reference, tmp_path):
    """The reference's step-4 checkpoint resumed to 6 (a run that then stops with its own end-of-run
    checkpoint), resumed again to 8, equals 8 straight steps: every loss, grad norm, val loss, LR, and the
    final parameters; the data position after the second resume is 8 steps' worth."""
    ref_dir, ref = cpu4_reference
    run = tmp_path / "run"
    recs = run_trainer([*CPU4, "train.iters=6", f"resume.from={ref_dir / 'checkpoints' / 'iter_0000004'}"], 4, run)
    assert [r["step"] for r in recs] == [5, 6] and _latest(run) == "iter_0000006"
    _assert_same_steps(recs, ref, range(5, 7))
    recs = run_trainer([*CPU4, "train.iters=8"], 4, run)  # resumes from its own iter 6 automatically
    assert [r["step"] for r in recs] == [5, 6, 7, 8]
    _assert_same_steps(recs, ref, range(5, 9))
    st = _state(run)
    tokens_per_step = ref[0]["consumed_tokens"]
    assert st["step"] == 8 and st["consumed_tokens"] == 8 * tokens_per_step
    assert st["consumed_samples_in_context"] == 8 * ref[0]["global_batch_size"]

    want = _model_tensors(ref_dir / "checkpoints" / "iter_0000008", tmp_path)
    assert len(want) > 50
    got = _model_tensors(run / "checkpoints" / "iter_0000008", tmp_path)
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad[:5]


@pytest.mark.slow
def test_sigterm_to_one_rank_mid_step_saves_that_step_everywhere(cpu4_reference, tmp_path):
    """Rank 3 alone gets SIGTERM during step 3: all ranks finish step 3, save it, exit with the requeue
    code; the resumed run matches the uninterrupted one. wandb offline (its default) on rank 0."""
    _, ref = cpu4_reference
    run_dir = tmp_path / "run"
    recs = run_trainer([*CPU4, "train.iters=8", "run.wandb.mode=offline"], 4, run_dir, script="fault_train.py",
                       env={"K2_FAULT": "sigterm_train:3:3"}, expect_failure=True)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert _latest(run_dir) == "iter_0000003" and _state(run_dir)["reason"] == "preempted: signal"
    assert (run_dir / "requeue").read_text().strip() == "3"
    recs = run_trainer([*CPU4, "train.iters=8", "run.wandb.mode=offline"], 4, run_dir)
    assert not (run_dir / "requeue").exists()
    _assert_same_steps(recs, ref, range(1, 9))


@pytest.mark.slow
def test_sigterm_during_validation_saves_after_it(cpu4_reference, tmp_path):
    _, ref = cpu4_reference
    run_dir = tmp_path / "run"
    recs = run_trainer([*CPU4, "train.iters=8"], 4, run_dir, script="fault_train.py",
                       env={"K2_FAULT": "sigterm_eval:4:1"}, expect_failure=True)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and "val_loss" in recs[-1]
    assert _latest(run_dir) == "iter_0000004" and _state(run_dir)["reason"] == "preempted: signal"
    _assert_same_steps(recs, ref, range(1, 5))  # validation finished before the save
    # (resuming from a preemption save: test_sigterm_to_one_rank_mid_step_saves_that_step_everywhere)


@pytest.mark.slow
def test_sigusr1_during_a_periodic_save_stops_at_that_step(tmp_path, stdlib_corpus):
    """One rank, wandb offline. SIGUSR1 arrives while step 2's periodic checkpoint is written: the run
    stops after step 2 -- the step in progress when the notice came -- with that checkpoint and exit 42,
    instead of training step 3 first."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(SCRIPTS / "fault_train.py"), "train.iters=8",
           "train.save_interval=2", "train.eval_interval=0", "train.progress=false", "run.wandb.mode=offline",
           f"run.dir={run_dir}"]
    p = subprocess.run(cmd, cwd=REPO, env=trainer_env({"K2_FAULT": "sigusr1_save:2:0"}), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 42, p.stdout[-3000:] + p.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "SIGUSR1 received during step 2; saving a checkpoint at the end of step 2" in p.stdout, p.stdout[-3000:]
    assert _latest(run_dir) == "iter_0000002" and (run_dir / "requeue").read_text().strip() == "2"


@pytest.mark.slow
def test_save_killed_half_way_leaves_previous_latest(cpu4_reference, tmp_path):
    """Rank 2 dies after writing its shards of step 4 and before the checkpoint is made visible: latest
    stays at step 2, the partial directory is never loaded (and is removed), the resume matches."""
    _, ref = cpu4_reference
    run_dir = tmp_path / "run"
    run_trainer([*CPU4, "train.iters=8", "train.save_interval=2"], 4, run_dir, script="fault_train.py",
                env={"K2_FAULT": "crash_save:4:2"}, expect_failure=True)
    ckpts = run_dir / "checkpoints"
    assert _latest(run_dir) == "iter_0000002"
    assert (ckpts / "iter_0000004.partial").is_dir() and not (ckpts / "iter_0000004").exists()
    recs = run_trainer([*CPU4, "train.iters=8", "train.save_interval=2"], 4, run_dir)
    assert not (ckpts / "iter_0000004.partial").exists()
    # steps 3-4 were logged before the crash and are run again: metrics.jsonl keeps the re-run ones
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert [r.get("replayed", False) for r in recs] == [False] * 2 + [True] * 2 + [False] * 4
    replayed = [json.loads(x) for x in (run_dir / "metrics.replayed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replayed] == [3, 4]
    _assert_same_steps(recs, ref, range(1, 9))
    # retention: keep_last=2 (default) plus the one latest names
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["iter_0000006", "iter_0000008"]


# MuonClip (Distributed Muon on the byte-range ZeRO-1 shards, whose momentum megatron reshards, and
# AdamW's moments for the embedding, head and norms), Newton-Schulz in fp32 so that the DP reduction
# order moves the losses by fp32 rounding only (tests/integration/test_muonclip_parallel.py)
DP_RESUME = ["optim=muonclip", "optim.muon_fp32_matmul_prec=highest", "train.eval_interval=0"]


@pytest.fixture(scope="module")
def dp_references(tmp_path_factory, stdlib_corpus):
    """6 steps at DP=1 and at DP=2 (PP1), each with a checkpoint at step 3: {dp: (run dir, records)}."""
    root = tmp_path_factory.mktemp("dp")
    base = [*DP_RESUME, "train.save_interval=3", "train.iters=6"]
    return {dp: (root / f"dp{dp}", run_trainer(base, dp, root / f"dp{dp}")) for dp in (1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_resume_with_another_dp_size(dp_references, tmp_path, first, second):
    """MuonClip, DP=2 -> DP=1 and DP=1 -> DP=2 (megatron reshards the distributed optimizers): the step-3 checkpoint
    of a run at one DP size resumed at the other gives the same data order (tokens, LR) and the same
    losses within fp32 reduction-order tolerance as the run at the first DP size."""
    ref_dir, ref = dp_references[first]
    ckpt = ref_dir / "checkpoints" / "iter_0000003"
    assert ckpt.is_dir()
    run_dir = tmp_path / "run"
    recs = run_trainer([*DP_RESUME, "train.iters=6", f"resume.from={ckpt}"], second, run_dir)
    assert [r["step"] for r in recs] == [4, 5, 6]
    assert _state(run_dir)["layout"]["dp"] == second
    r = _by_step(ref)
    for got in recs:
        s = got["step"]
        assert got["consumed_tokens"] == r[s]["consumed_tokens"] and got["lr"] == r[s]["lr"]
        assert got["loss"] == pytest.approx(r[s]["loss"], rel=2e-6), s


def _k2_train(run_dir: Path, *overrides: str) -> list[str]:
    """``k2-train`` with wandb in its default mode (offline) and no progress bar."""
    return [sys.executable, "-m", "k2.launcher.train", *overrides, "train.progress=false",
            "run.wandb.mode=offline", f"run.dir={run_dir}"]


def _wait_for_lines(path: Path, n: int, p: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not (path.exists() and path.read_text().count("\n") >= n):
        assert p.poll() is None and time.time() < deadline, f"no {n} lines in {path} (exit {p.poll()})"
        time.sleep(0.5)


def _left(run_dir: Path) -> list[str]:
    return subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()


@pytest.mark.slow
def test_sigterm_to_k2_train_saves_and_exits_with_requeue_code(tmp_path, stdlib_corpus):
    """wandb offline (the default). SIGTERM to the k2-train process (as a job manager does) stops every
    rank after a checkpoint of the same step -- wandb's service is not signalled -- and k2-train exits
    with 42 without torchrun's failure report; no rank is orphaned. Then, while the resumed run trains,
    a second trainer on the busy run dir is refused with exit 2 and one line naming the owner (host, pid
    of k2-train) and the run dir, touching nothing; ``kill -9`` of k2-train: its ranks are gone within
    10 s."""
    run_dir = tmp_path / "run"
    cmd = _k2_train(run_dir, "parallel=pp2", "train.iters=500", "train.eval_interval=0")
    p = subprocess.Popen(cmd, cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    try:
        _wait_for_lines(metrics, 2, p)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 42, out[-3000:]
    assert "ChildFailedError" not in out and "FAILED" not in out, out[-3000:]
    assert "wandb failed" not in out, out[-3000:]  # its service was not signalled
    logged = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert _state(run_dir)["step"] == logged[-1] and 2 <= logged[-1] < 500
    assert _state(run_dir)["reason"] == "preempted: signal"
    assert not _left(run_dir), _left(run_dir)

    p = subprocess.Popen(cmd, cwd=REPO, env=trainer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        _wait_for_lines(metrics, len(logged) + 1, p)
        second = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("k2-train: error: "), second.stderr
        assert f"host {socket.gethostname()}, pid {p.pid}" in err[0] and str(run_dir) in err[0], err
        os.kill(p.pid, signal.SIGKILL)  # k2-train alone: torchrun and the ranks are not signalled by us
        t0 = time.time()
        while _left(run_dir) and time.time() - t0 < 10:
            time.sleep(0.1)
        gone_after = time.time() - t0
        print(f"ranks gone {gone_after:.2f} s after kill -9 of k2-train")
        assert not _left(run_dir), (gone_after, _left(run_dir))
    finally:
        os.killpg(p.pid, signal.SIGKILL)
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, steps[-1] + 1)), steps  # the refused trainer wrote nothing
    assert _state(run_dir)["step"] == logged[-1]  # nor removed or replaced a checkpoint


@pytest.mark.slow
def test_two_trainers_started_together_on_one_run_dir(tmp_path, stdlib_corpus):
    """Two single-process trainers started at the same moment on one run dir: one runs, the other exits 2
    with one line naming the first (host, pid); the run's metrics have each step once."""
    run_dir = tmp_path / "run"
    cmd = _k2_train(run_dir, "train.iters=3", "train.eval_interval=0")
    ps = [subprocess.Popen(cmd, cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True) for _ in range(2)]
    outs = [q.communicate(timeout=300) for q in ps]
    rcs = [q.returncode for q in ps]
    assert sorted(rcs) == [0, 2], (rcs, [o[1][-2000:] for o in outs])
    winner, loser = (0, 1) if rcs[0] == 0 else (1, 0)
    err = outs[loser][1].strip().splitlines()
    assert len(err) == 1 and f"host {socket.gethostname()}, pid {ps[winner].pid}" in err[0], err
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert _latest(run_dir) == "iter_0000003"
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.slow
def test_sigusr1_during_startup_then_wall_time_budget_stop_with_checkpoints_in_one_wandb_run(tmp_path, stdlib_corpus):
    """A single rank. Slurm's USR1 notice arriving during start-up (after the process group, before the
    first step) ends the run after step 1 with a checkpoint and exit status 42 -- not killed by the
    signal's default action. The resumed run stops again at run.max_minutes after one more step, with a
    checkpoint and 42, and continues the same wandb run (offline here: a second offline-run directory with
    the same id, which `wandb sync` appends to the one run)."""
    run_dir = tmp_path / "run"
    common = [sys.executable, "-m", "k2.launcher.train", "train.iters=500", "train.eval_interval=0",
              "train.progress=false", "run.wandb.mode=offline", f"run.dir={run_dir}"]
    p = subprocess.Popen(common, cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        seen = []
        for line in p.stdout:  # printed inside run(), after the process group exists, before the build
            seen.append(line)
            if line.startswith("k2-data:"):
                break
        assert not (run_dir / "metrics.jsonl").exists(), "the run started its steps before the signal"
        p.send_signal(signal.SIGUSR1)
        out = "".join(seen) + p.communicate(timeout=180)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 42 and "SIGUSR1 received during start-up" in out, out[-3000:]
    first = _state(run_dir)
    assert first["reason"] == "preempted: signal" and first["step"] == 1

    p = subprocess.run([*common, "run.max_minutes=0.001"], cwd=REPO, env=trainer_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 42, p.stderr[-3000:]
    st = _state(run_dir)
    assert st["reason"] == "preempted: run.max_minutes" and st["step"] == 2

    ids = {first["wandb_run_id"], st["wandb_run_id"]}
    assert len(ids) == 1 and None not in ids
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    rid = ids.pop()
    assert len(runs) == 2 and all(r.name.endswith("-" + rid) for r in runs), runs


# --- no process group: the resume decision, retention, metrics replay, preemption flag ---------------






















