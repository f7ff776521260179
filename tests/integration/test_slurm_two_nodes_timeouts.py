"""Two real Slurm nodes on one machine (tests/support/slurm_two_nodes.py), driven through ``k2-submit``:
a node whose ranks never start fails the rendezvous with one line naming it, and Slurm's own time-limit
notice (``--signal=USR1@N``) saves the step in progress and requeues the job. (The bitwise two-node run
through a requeue and a lost node is test_slurm_two_nodes.py, on another xdist worker with a cluster of
its own.)

Needs root (namespaces, munged, slurmd), like tests/integration/test_slurm_real.py; skipped only where the
kernel refuses network namespaces or veth pairs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from support import REPO
from support.slurm_local import wait_for
from support.slurm_two_node_jobs import DONE, JOB, Job, no_ranks_left, ranks
from support.slurm_two_nodes import KILL_WAIT_S, NODES

pytestmark = pytest.mark.slow


def test_a_node_that_never_starts_fails_the_rendezvous_naming_it(two_nodes, tmp_path):
    """The second node's ranks never start (their Python is a ``sleep`` there): the first node's ranks wait
    ``launch.rendezvous_timeout_s``, then stop with one line naming the missing ranks and node, and the job
    fails (srun's --kill-on-bad-exit ends the sleepers)."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ "$(hostname)" = {NODES[1]} ] && exec sleep 600\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    timeout_s = 20
    job = Job(
        two_nodes,
        tmp_path / "run",
        [*JOB, "train.iters=2", f"launch.rendezvous_timeout_s={timeout_s}", f"submit.python={python}"],
    )
    try:
        wait_for(
            lambda: ranks(two_nodes, NODES[0]), 300, lambda: f"the ranks of job {job.id} on {NODES[0]}: {job.log()}"
        )
        t0 = time.time()
        state = job.wait_done(timeout=timeout_s + KILL_WAIT_S + 150)
        waited_s = time.time() - t0
    finally:
        job.cancel_if_running()
    out = job.log(tail=10**7)
    print(f"late node: the job failed {waited_s:.1f} s after its first node's ranks started")
    assert state == "FAILED", out
    want = (
        f"k2-train: error: rendezvous at MASTER_ADDR:MASTER_PORT={NODES[0]}:",
        f"2 of 4 ranks arrived "
        f"within {timeout_s} s (launch.rendezvous_timeout_s); missing ranks 1, 3; arrived: {NODES[0]}: ranks "
        f"0, 2; nodes of SLURM_JOB_NODELIST=k2node[1-2] with no rank at the rendezvous: {NODES[1]}",
    )
    assert all(w in out for w in want) and "Traceback" not in out, out[-6000:]
    assert waited_s >= timeout_s - 15, waited_s  # (the ranks had imported the trainer before the clock ran)
    no_ranks_left(two_nodes)


def test_the_time_limit_notice_saves_and_requeues(two_nodes, tmp_path):
    """Slurm's own ``--signal=USR1@N`` (not scancel): a one-rank job with a 3-minute limit and the notice
    90 s before it (Slurm sends it up to a minute early) is still training when the notice comes; the rank
    saves the step in progress, exits 42 and the script requeues the job, before the limit would kill it.
    (Each step of the job first sleeps 6 s, tests/support/scripts/slow_steps_train.py: the minute or two
    until the notice costs a fraction of the CPU of steps back to back.)"""
    limit_min, notice_s, step_sleep_s = 3, 90, 6
    python = tmp_path / "python"  # submit.python: k2.launcher.train's steps through slow_steps_train.py
    python.write_text(
        f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = k2.launcher.train ]; then shift 2; '
        f"export K2_STEP_SLEEP_S={step_sleep_s}; "
        f'exec {sys.executable} {REPO / "tests/support/scripts/slow_steps_train.py"} "$@"; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    long_run = [
        "parallel=single",
        "schedule.phases.1.until_tokens=20_000_000",
        "schedule.phases.2.until_tokens=30_000_000",
        "train.save_interval=null",
        "train.eval_interval=0",
        "train.progress=false",
        "run.wandb.mode=disabled",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "submit.request_gpus=false",
        f"submit.time={limit_min}",
        f"submit.signal_seconds={notice_s}",
        f"submit.python={python}",
    ]
    job = Job(two_nodes, tmp_path / "run", long_run)
    try:
        wait_for(
            lambda: job.cluster.job_field(job.id, "Restarts") == "1",
            limit_min * 60 + 60,
            lambda: f"job {job.id} to be requeued by its time-limit notice: {job.log()}",
            every=2,
        )
        out = job.log(tail=10**7)
    finally:
        subprocess.run(["scancel", job.id], env=two_nodes.env)
    assert "SIGUSR1 received" in out and "preempted: signal" in out, out[-4000:]
    assert "the trainer asked for a requeue (exit status 42)" in out, out[-4000:]
    assert "TIME LIMIT" not in out and "DUE TO TIME" not in out, out[-4000:]
    ckpts = job.run_dir / "checkpoints"
    saved = json.loads((ckpts / (ckpts / "latest").read_text().strip() / "k2_state.json").read_text())["step"]
    assert saved == job.steps() >= 1, (saved, job.steps())  # the step in progress, nothing lost
    wait_for(lambda: job.state() in DONE, 60, lambda: f"job {job.id} to be cancelled")
    no_ranks_left(two_nodes)
