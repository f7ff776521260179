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
kernel refuses network namespaces or veth pairs. (The cluster's other tests, a node that never starts and
the time-limit notice, are in test_slurm_two_nodes_timeouts.py: a file of their own runs on another xdist
worker, with a cluster of its own, while this one runs.)
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from support.distributed import run_trainer
from support.slurm_local import wait_for
from support.slurm_two_node_jobs import TRAIN, Job, no_ranks_left, ranks
from support.slurm_two_nodes import KILL_WAIT_S, NODES, SLURMD_TIMEOUT_S

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory, stdlib_corpus):
    """The same training on one node: 4 local gloo ranks, without the checkpoints (nothing reads them)."""
    no_saves = [*(x for x in TRAIN if not x.startswith("train.save_interval")), "checkpoint.save_at_end=false"]
    return run_trainer(no_saves, 4, tmp_path_factory.mktemp("ref") / "run")


def _losses(records):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def _tcp_peers(cluster, node: str) -> set[str]:
    """The remote addresses of the established TCP connections in ``node``'s namespace."""
    out = subprocess.run(
        ["ip", "netns", "exec", cluster.netns(node), "ss", "-tnH", "state", "established"],
        capture_output=True,
        text=True,
    ).stdout
    return {line.split()[-1].rsplit(":", 1)[0] for line in out.splitlines() if line.split()}


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
        placed = {n: ranks(two_nodes, n) for n in NODES}
        peers = _tcp_peers(two_nodes, NODES[1])
        two_nodes.scontrol("requeue", job.id)  # SIGTERM to every rank on both nodes: they save, exit 42
        two_nodes.restart_now(job.id, 1, job.log)
        wait_for(
            lambda: "resumed from" in job.log(tail=10**7) and job.steps() >= 4 and ranks(two_nodes, NODES[1]),
            300,
            lambda: f"step 4 of job {job.id} after its requeue: {job.log()}",
        )
        t0 = time.time()
        two_nodes.lose_node(NODES[1])  # cable pulled, then slurmd, slurmstepd and both ranks SIGKILLed
        # slurmctld notices within SlurmdTimeout, requeues the job and kills its ranks on the first node
        # (SIGTERM, SIGKILL KillWait later): none waits on the lost peer
        bound = SLURMD_TIMEOUT_S + KILL_WAIT_S + 60
        wait_for(
            lambda: not ranks(two_nodes, NODES[0]) and job.state() == "PENDING",
            bound,
            lambda: f"the job to end on {NODES[0]} and pend: {job.state()} {ranks(two_nodes, NODES[0])} {job.log()}",
        )
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
    print(
        f"lost node: the job ended on the surviving node {ended_s:.1f} s after the loss; resumed from step {saved_step}"
    )
    assert state == "COMPLETED" and job.cluster.job_field(job.id, "Restarts") == "2", out[-4000:] + two_nodes.diagnose(
        job.id
    )
    # cyclic: ranks 0, 2 on the first node, 1, 3 on the second, each process on its node's hostname
    assert {n: sorted(r) for n, r in placed.items()} == {NODES[0]: [0, 2], NODES[1]: [1, 3]}, placed
    assert all(r["hostname"] == n for n, ranks in placed.items() for r in ranks.values()), placed
    # the stage's ranks on different nodes
    stage0 = _stage0_ranks()
    assert stage0 == {0, 1} and {n for n, r in placed.items() if set(r) & stage0} == set(NODES)
    # MASTER_ADDR is the first host of the node list, on both nodes, and node 2 talks to node 1 over the link
    assert {r["MASTER_ADDR"] for ranks in placed.values() for r in ranks.values()} == {NODES[0]}
    assert f"master {NODES[0]}:" in out and two_nodes.addrs[NODES[0]] in peers, (out[-4000:], peers)
    # the requeue saved the step in progress (nothing re-run); the lost node's steps since the last
    # periodic checkpoint are re-run from it
    assert "SIGTERM received" in out and out.count("k2-train: resumed from") == 2, out[-4000:]
    assert f"{latest.name} (step {saved_step}," in out, out[-4000:]  # the second resume: from the latest
    assert _losses(job.records()) == _losses(reference)
    no_ranks_left(two_nodes)
