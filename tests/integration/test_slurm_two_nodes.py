"""Two real Slurm nodes on one machine (tests/support/slurm_two_nodes.py: two network namespaces on a
bridge, each with its own hostname and slurmd), driven through ``k2-submit`` as a user would: a 2-node
x 2-rank CPU job (gloo over the veth links) whose losses equal a 1-node 4-rank run bit for bit across a
requeue mid-run and one node lost mid-step (link pulled, its slurmd and ranks killed) and brought back.

Rank placement: ``parallel=cpu4`` is PP2 x VPP2 x EP2 (DP2); megatron's rank order (tp-cp-ep-dp-pp) puts
PP outermost, so stage 0 is ranks {0, 1} and stage 1 is {2, 3}. ``submit.distribution=cyclic`` makes
srun deal the ranks round-robin (rank r on node r % 2): each stage has one rank on each node, so its EP
all-to-all and DP reductions cross the veth link; the pipeline's sends stay on a node. The test reads
each running rank's ``SLURM_PROCID``, ``MASTER_ADDR`` and hostname from the processes themselves, and
the TCP peers of node 2's ranks.

Why bitwise: the ranks compute the same thing whatever host they run on (same rank numbers, same
data shards, one OpenMP thread, the same CPU); gloo's reduction algorithms depend on the group's size
and rank order, not on the transport, so every sum is taken in the same order as in the one-node run.

Needs root (namespaces, munged, slurmd), like tests/integration/test_slurm_real.py; skipped only where the
kernel refuses network namespaces or veth pairs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO
from support.distributed import run_trainer, trainer_env
from support.slurm_local import wait_for
from support.slurm_two_nodes import (ADDRS, KILL_WAIT_S, NODES, SLURMD_TIMEOUT_S, NamespacesRefused,
                                     TwoNodeSlurm, netns, netns_pids)

pytestmark = pytest.mark.slow

TRAIN = ["parallel=cpu4", "train.iters=8", "train.save_interval=2", "train.eval_interval=0",
         "train.progress=false", "run.wandb.mode=disabled"]
JOB = [*TRAIN, "cluster.nodes=2", "cluster.gpus_per_node=2", "submit.request_gpus=false",
       "submit.distribution=cyclic", "submit.time=30", "submit.embedded_corpus=true"]
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    cluster = TwoNodeSlurm(tmp_path_factory.mktemp("slurm2"))
    try:
        cluster.start()
    except NamespacesRefused as e:
        pytest.skip(f"the kernel refuses network namespaces here: {e}")
    yield cluster
    cluster.stop()
    assert cluster.leftovers() == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory, stdlib_corpus):
    """The same training on one node: 4 local gloo ranks."""
    return run_trainer(TRAIN, 4, tmp_path_factory.mktemp("ref") / "run")


def _losses(records):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


class Job:
    """One ``k2-submit`` job on the two-node cluster and what the test reads of it."""

    def __init__(self, cluster: TwoNodeSlurm, run_dir: Path, overrides=JOB, env: dict | None = None):
        self.cluster, self.run_dir = cluster, run_dir
        env = trainer_env({**cluster.env, "OMP_NUM_THREADS": "1", **(env or {})})
        sub = subprocess.run([sys.executable, "-c", "from k2.launcher.submit import cli; cli()", *overrides,
                              f"run.dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600)  # (k2-submit took > 120 s once on the loaded 2-core machine)
        assert sub.returncode == 0, sub.stderr
        self.id = sub.stdout.strip().splitlines()[0]

    def steps(self) -> int:
        m = self.run_dir / "metrics.jsonl"
        return len(m.read_text().splitlines()) if m.exists() else 0

    def records(self) -> list[dict]:
        return [json.loads(x) for x in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def log(self, tail: int = 4000) -> str:
        f = self.run_dir / f"slurm-{self.id}.out"
        return f.read_text()[-tail:] if f.exists() else "(no log)"

    def state(self) -> str:
        return self.cluster.job_field(self.id, "JobState")

    def wait_done(self, timeout: float = 600) -> str:
        wait_for(lambda: self.state() in DONE, timeout, lambda: f"job {self.id} to end: {self.log()}", every=1)
        return self.state()

    def cancel_if_running(self) -> None:
        if self.state() not in DONE:
            subprocess.run(["scancel", self.id], env=self.cluster.env)


def _ranks(node: str) -> dict[int, dict]:
    """The trainer ranks running on ``node``: ``{SLURM_PROCID: {"MASTER_ADDR", "hostname", "pid"}}``,
    read from the processes (their environment and their UTS namespace)."""
    out = {}
    for pid in netns_pids(node):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"k2.launcher.train" not in cmd or b"SLURM_PROCID" not in env:
            continue
        host = subprocess.run(["nsenter", f"--target={pid}", "--uts", "hostname"], capture_output=True,
                              text=True).stdout.strip()
        out[int(env[b"SLURM_PROCID"])] = {"MASTER_ADDR": env.get(b"MASTER_ADDR", b"").decode(),
                                          "hostname": host, "pid": pid}
    return out


def _tcp_peers(node: str) -> set[str]:
    """The remote addresses of the established TCP connections in ``node``'s namespace."""
    out = subprocess.run(["ip", "netns", "exec", netns(node), "ss", "-tnH", "state", "established"],
                         capture_output=True, text=True).stdout
    return {line.split()[-1].rsplit(":", 1)[0] for line in out.splitlines() if line.split()}


def _no_ranks_left(cluster: TwoNodeSlurm, timeout: float = 60) -> None:
    """Every node holds only its slurmd once the job is over (no rank, no slurmstepd)."""
    def only_slurmd():
        left = {}
        for n in NODES:
            slurmd = int(cluster.pidfile(n).read_text()) if cluster.pidfile(n).exists() else -1
            extra = [p for p in netns_pids(n) if p != slurmd]
            if extra:
                left[n] = extra
        return not left or None
    wait_for(only_slurmd, timeout, lambda: f"the nodes to hold only their slurmd: "
             f"{ {n: [Path(f'/proc/{p}/cmdline').read_bytes()[:80] for p in netns_pids(n)] for n in NODES} }")


def _stage0_ranks() -> set[int]:
    """Pipeline stage 0's ranks in megatron's own rank order for cpu4 (world 4, PP2)."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=1, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    return {group[0] for group in gen.get_ranks("pp")}


def test_two_nodes_match_one_node_bitwise_across_a_requeue_and_a_lost_node(two_nodes, reference, tmp_path):
    """One 2-node x 2-rank job, through two faults, against the 1-node 4-rank run:

    * as placed (cyclic), named (each node's hostname) and wired (MASTER_ADDR, the link in use);
    * requeued mid-run with ``scontrol requeue`` (SIGTERM to every rank on both nodes: they save and
      exit 42; the script requeues the job, which resumes without re-running a step);
    * then one node lost mid-step (cable pulled, its slurmd, slurmstepd and ranks SIGKILLed): slurmctld
      notices within SlurmdTimeout, requeues the job and stops the surviving node's ranks within a
      bounded time (none waits on the lost peer forever); the latest checkpoint is intact; once the node
      is back the job resumes from it;
    * every step's loss and grad norm equals the 1-node run bit for bit.

    (One job for all of it: each job start costs every rank a fresh interpreter, the suite's time.)"""
    from k2.launcher.checkpointing.manifest import verify

    job = Job(two_nodes, tmp_path / "run")
    ckpts = job.run_dir / "checkpoints"
    try:
        wait_for(lambda: job.steps() >= 2, 300, lambda: f"step 2 of job {job.id}: {job.log()}")
        placed = {n: _ranks(n) for n in NODES}
        peers = _tcp_peers(NODES[1])
        two_nodes.scontrol("requeue", job.id)  # SIGTERM to every rank on both nodes: they save, exit 42
        two_nodes.restart_now(job.id, 1, job.log)
        wait_for(lambda: "resumed from" in job.log(tail=10**7) and job.steps() >= 4 and _ranks(NODES[1]), 300,
                 lambda: f"step 4 of job {job.id} after its requeue: {job.log()}")
        t0 = time.time()
        two_nodes.lose_node(NODES[1])  # cable pulled, then slurmd, slurmstepd and both ranks SIGKILLed
        # slurmctld notices within SlurmdTimeout, requeues the job and kills its ranks on the first node
        # (SIGTERM, SIGKILL KillWait later): none waits on the lost peer
        bound = SLURMD_TIMEOUT_S + KILL_WAIT_S + 60
        wait_for(lambda: not _ranks(NODES[0]) and job.state() == "PENDING", bound,
                 lambda: f"the job to end on {NODES[0]} and pend: {job.state()} {_ranks(NODES[0])} {job.log()}")
        ended_s = time.time() - t0
        latest = ckpts / (ckpts / "latest").read_text().strip()
        assert verify(latest) == [], latest  # every file of the latest checkpoint as its manifest says
        saved_step = json.loads((latest / "k2_state.json").read_text())["step"]
        two_nodes.restore_node(NODES[1])
        two_nodes.wait_idle(NODES)
        time.sleep(3)  # (restart_now: a relaunch needs a credential newer than the killed run's)
        two_nodes.scontrol("update", f"jobid={job.id}", "StartTime=now")
        state = job.wait_done()
    finally:
        job.cancel_if_running()
    out = job.log(tail=10**7)
    print(f"lost node: the job ended on the surviving node {ended_s:.1f} s after the loss; resumed from step "
          f"{saved_step}")
    assert state == "COMPLETED" and job.cluster.job_field(job.id, "Restarts") == "2", \
        out[-4000:] + two_nodes.diagnose(job.id)
    # cyclic: ranks 0, 2 on the first node, 1, 3 on the second, each process on its node's hostname
    assert {n: sorted(r) for n, r in placed.items()} == {NODES[0]: [0, 2], NODES[1]: [1, 3]}, placed
    assert all(r["hostname"] == n for n, ranks in placed.items() for r in ranks.values()), placed
    # the stage's ranks on different nodes
    stage0 = _stage0_ranks()
    assert stage0 == {0, 1} and {n for n, r in placed.items() if set(r) & stage0} == set(NODES)
    # MASTER_ADDR is the first host of the node list, on both nodes, and node 2 talks to node 1 over the link
    assert {r["MASTER_ADDR"] for ranks in placed.values() for r in ranks.values()} == {NODES[0]}
    assert f"master {NODES[0]}:" in out and ADDRS[NODES[0]] in peers, (out[-4000:], peers)
    # the requeue saved the step in progress (nothing re-run); the lost node's steps since the last
    # periodic checkpoint are re-run from it
    assert "SIGTERM received" in out and out.count("k2-train: resumed from") == 2, out[-4000:]
    assert f"{latest.name} (step {saved_step}," in out, out[-4000:]  # the second resume: from the latest
    assert _losses(job.records()) == _losses(reference)
    _no_ranks_left(two_nodes)


def test_a_node_that_never_starts_fails_the_rendezvous_naming_it(two_nodes, tmp_path):
    """The second node's ranks never start (their Python is a ``sleep`` there): the first node's ranks wait
    ``launch.rendezvous_timeout_s``, then stop with one line naming the missing ranks and node, and the job
    fails (srun's --kill-on-bad-exit ends the sleepers)."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ "$(hostname)" = {NODES[1]} ] && exec sleep 600\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    timeout_s = 20
    job = Job(two_nodes, tmp_path / "run", [*JOB, "train.iters=2", f"launch.rendezvous_timeout_s={timeout_s}",
                                             f"submit.python={python}"])
    try:
        wait_for(lambda: _ranks(NODES[0]), 300, lambda: f"the ranks of job {job.id} on {NODES[0]}: {job.log()}")
        t0 = time.time()
        state = job.wait_done(timeout=timeout_s + KILL_WAIT_S + 150)
        waited_s = time.time() - t0
    finally:
        job.cancel_if_running()
    out = job.log(tail=10**7)
    print(f"late node: the job failed {waited_s:.1f} s after its first node's ranks started")
    assert state == "FAILED", out
    want = (f"k2-train: error: rendezvous at MASTER_ADDR:MASTER_PORT={NODES[0]}:", f"2 of 4 ranks arrived "
            f"within {timeout_s} s (launch.rendezvous_timeout_s); missing ranks 1, 3; arrived: {NODES[0]}: ranks "
            f"0, 2; nodes of SLURM_JOB_NODELIST=k2node[1-2] with no rank at the rendezvous: {NODES[1]}")
    assert all(w in out for w in want) and "Traceback" not in out, out[-6000:]
    assert waited_s >= timeout_s - 15, waited_s  # (the ranks had imported the trainer before the clock ran)
    _no_ranks_left(two_nodes)


def test_the_time_limit_notice_saves_and_requeues(two_nodes, tmp_path):
    """Slurm's own ``--signal=USR1@N`` (not scancel): a one-rank job with a 3-minute limit and the notice
    90 s before it (Slurm sends it up to a minute early) is still training when the notice comes; the rank
    saves the step in progress, exits 42 and the script requeues the job, before the limit would kill it.
    (Each step of the job first sleeps 2 s, tests/support/scripts/slow_steps_train.py: the minute or two
    until the notice costs a fraction of the CPU of steps back to back.)"""
    limit_min, notice_s = 3, 90
    python = tmp_path / "python"  # submit.python: k2.launcher.train's steps through slow_steps_train.py
    python.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = k2.launcher.train ]; then shift 2; '
                      f'exec {sys.executable} {REPO / "tests/support/scripts/slow_steps_train.py"} "$@"; fi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    long_run = ["parallel=single", "schedule.phases.1.until_tokens=20_000_000", "schedule.phases.2.until_tokens=30_000_000",
                "train.save_interval=null",
                "train.eval_interval=0", "train.progress=false", "run.wandb.mode=disabled", "cluster.nodes=1",
                "cluster.gpus_per_node=1", "submit.request_gpus=false", f"submit.time={limit_min}",
                f"submit.signal_seconds={notice_s}", f"submit.python={python}"]
    job = Job(two_nodes, tmp_path / "run", long_run)
    try:
        wait_for(lambda: job.cluster.job_field(job.id, "Restarts") == "1", limit_min * 60 + 60,
                 lambda: f"job {job.id} to be requeued by its time-limit notice: {job.log()}", every=2)
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
    _no_ranks_left(two_nodes)
