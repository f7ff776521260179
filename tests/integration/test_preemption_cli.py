"""Preemption and run-directory ownership of whole ``k2-train`` processes (the launcher's parent, its
forked ranks, wandb in its default offline mode): SIGTERM as a job manager sends it, Slurm's USR1 notice
during start-up and during a periodic save, the wall-time budget, two trainers on one run dir.

The checkpoint and exact-resume tests of the ranks themselves: tests/integration/test_checkpoint.py.
Runs whose test neither signals k2-train's launcher nor reads a pid of its own are forked by the session's
fork server (tests/support/distributed.py ``rank_launch_cmd``: the same trainer, its imports done once per
session); the signals sent to its client process reach the run as they would reach k2-train.
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

from support import REPO, SCRIPTS
from support.distributed import rank_launch_cmd, trainer_env


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def _state(run_dir: Path, name: str | None = None) -> dict:
    return json.loads((run_dir / "checkpoints" / (name or _latest(run_dir)) / "k2_state.json").read_text())


@pytest.mark.slow
def test_sigusr1_during_a_periodic_save_stops_at_that_step(tmp_path, stdlib_corpus):
    """One rank, wandb offline. SIGUSR1 arrives while step 2's periodic checkpoint is written: the run
    stops after step 2 -- the step in progress when the notice came -- with that checkpoint and exit 42,
    instead of training step 3 first."""
    run_dir = tmp_path / "run"
    cmd = rank_launch_cmd(
        1,
        [str(SCRIPTS / "fault_train.py")],
        [
            "train.iters=8",
            "train.save_interval=2",
            "checkpoint.async_save=false",
            "train.eval_interval=0",
            "train.progress=false",
            "run.wandb.mode=offline",
            f"run.dir={run_dir}",
        ],
    )
    p = subprocess.run(
        cmd, cwd=REPO, env=trainer_env({"K2_FAULT": "sigusr1_save:2:0"}), capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 42, p.stdout[-3000:] + p.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "SIGUSR1 received during step 2; saving a checkpoint at the end of step 2" in p.stdout, p.stdout[-3000:]
    assert _latest(run_dir) == "iter_0000002" and (run_dir / "requeue").read_text().strip() == "2"


def _k2_train(run_dir: Path, *overrides: str) -> list[str]:
    """``k2-train`` with wandb in its default mode (offline) and no progress bar."""
    return [
        sys.executable,
        "-m",
        "k2.launcher.train",
        *overrides,
        "train.progress=false",
        "run.wandb.mode=offline",
        f"run.dir={run_dir}",
    ]


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
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
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

    p = subprocess.Popen(
        cmd, cwd=REPO, env=trainer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
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
    ps = [
        subprocess.Popen(cmd, cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
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
    common = [
        "train.iters=500",
        "train.eval_interval=0",
        "train.progress=false",
        "run.wandb.mode=offline",
        f"run.dir={run_dir}",
    ]
    trainer = ["-m", "k2.launcher.train"]
    p = subprocess.Popen(
        rank_launch_cmd(1, trainer, common),
        cwd=REPO,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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

    p = subprocess.run(
        rank_launch_cmd(1, trainer, [*common, "run.max_minutes=0.001"]),
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 42, p.stderr[-3000:]
    st = _state(run_dir)
    assert st["reason"] == "preempted: run.max_minutes" and st["step"] == 2

    ids = {first["wandb_run_id"], st["wandb_run_id"]}
    assert len(ids) == 1 and None not in ids
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    rid = ids.pop()
    assert len(runs) == 2 and all(r.name.endswith("-" + rid) for r in runs), runs
