"""``k2-submit`` jobs on the two-node Slurm cluster of tests/support/slurm_two_nodes.py, and what the tests
read of them: the job's state and log, its metrics, the trainer ranks running on each node (from the
processes themselves), and that every node holds only its slurmd once a job is over."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from support import REPO
from support.distributed import K2_SUBMIT, rank_launch_cmd, trainer_env
from support.slurm_local import wait_for
from support.slurm_two_nodes import NODES, TwoNodeSlurm

#: a cpu4 run (PP2 x VPP2 x EP2, DP2) of 8 steps, a checkpoint every 2
TRAIN = [
    "parallel=cpu4",
    "train.iters=8",
    "train.save_interval=2",
    "train.eval_interval=0",
    "train.progress=false",
    "run.wandb.mode=disabled",
]
#: :data:`TRAIN` as a 2-node x 2-rank job, the ranks dealt round-robin over the nodes
JOB = [
    *TRAIN,
    "cluster.nodes=2",
    "cluster.gpus_per_node=2",
    "submit.request_gpus=false",
    "submit.distribution=cyclic",
    "submit.time=30",
    "submit.embedded_corpus=true",
]
#: the job states after which a job runs no more (unless requeued)
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


class Job:
    """One ``k2-submit`` job on the two-node cluster and what the test reads of it."""

    def __init__(self, cluster: TwoNodeSlurm, run_dir: Path, overrides=JOB, env: dict | None = None):
        self.cluster, self.run_dir = cluster, run_dir
        env = trainer_env({**cluster.env, "OMP_NUM_THREADS": "1", **(env or {})})
        sub = subprocess.run(
            rank_launch_cmd(1, K2_SUBMIT, [*overrides, f"run.dir={run_dir}"]),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )  # (k2-submit took > 120 s once on the loaded 2-core machine)
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


def ranks(cluster: TwoNodeSlurm, node: str) -> dict[int, dict]:
    """The trainer ranks running on ``node``: ``{SLURM_PROCID: {"MASTER_ADDR", "hostname", "pid"}}``,
    read from the processes (their environment and their UTS namespace)."""
    out = {}
    for pid in cluster.netns_pids(node):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"k2.launcher.train" not in cmd or b"SLURM_PROCID" not in env:
            continue
        host = subprocess.run(
            ["nsenter", f"--target={pid}", "--uts", "hostname"], capture_output=True, text=True
        ).stdout.strip()
        out[int(env[b"SLURM_PROCID"])] = {
            "MASTER_ADDR": env.get(b"MASTER_ADDR", b"").decode(),
            "hostname": host,
            "pid": pid,
        }
    return out


def no_ranks_left(cluster: TwoNodeSlurm, timeout: float = 60) -> None:
    """Every node holds only its slurmd once the job is over (no rank, no slurmstepd)."""

    def only_slurmd():
        left = {}
        for n in NODES:
            slurmd = int(cluster.pidfile(n).read_text()) if cluster.pidfile(n).exists() else -1
            extra = [p for p in cluster.netns_pids(n) if p != slurmd]
            if extra:
                left[n] = extra
        return not left or None

    wait_for(
        only_slurmd,
        timeout,
        lambda: (
            f"the nodes to hold only their slurmd: "
            f"{ {n: [Path(f'/proc/{p}/cmdline').read_bytes()[:80] for p in cluster.netns_pids(n)] for n in NODES} }"
        ),
    )
