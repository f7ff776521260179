"""A real Slurm, not a mock: a one-node slurmctld + slurmd on localhost (tests/support/slurm_local.py),
the rendered slurm pretrain script submitted with ``k2-submit`` (sbatch), requeued mid-run with
``scontrol requeue`` (SIGTERM to every process of the step, wandb's service included), with wandb in its
default offline mode, after an earlier start of the same job was SIGKILLed before its first checkpoint; the
job must finish with the same losses as an uninterrupted run, bit for bit.
(Slurm's own time-limit notice, ``--signal=USR1@N``, saving and requeueing a job:
tests/integration/test_slurm_two_nodes_timeouts.py.)

Needs root (munged, slurmd) and Slurm installed, or ``K2_INSTALL_SLURM=1`` to install it (CI does; skipped
otherwise). Where Slurm cannot start, the test fails with the step that failed, unless
``K2_ALLOW_NO_SLURM=1`` (then it skips, naming the reason).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import psutil
import pytest

from support import REPO
from support.distributed import K2_SUBMIT, fork_server_python, rank_launch_cmd, run_trainer, trainer_env
from support.slurm_local import wait_for as _wait

pytestmark = pytest.mark.slow

JOB = [
    "parallel=pp2",
    "cluster.nodes=1",
    "cluster.gpus_per_node=2",
    "submit.request_gpus=false",
    "submit.time=30",
    "submit.signal_seconds=60",
    "train.iters=8",
    "train.save_interval=2",
    "train.eval_interval=0",
    "train.progress=false",
    "run.wandb.mode=offline",
    # the cluster options Slurm checks on one node: --mem=0 (the default), --cpus-per-task, an extra option
    "submit.cpus_per_task=1",
    "submit.extra_args=['--comment=k2-slurm-options']",
]


def _submit(slurm, job_args: list, run_dir) -> str:
    """k2-submit ``job_args`` into ``run_dir`` on the local Slurm; the job id."""
    env = trainer_env({**slurm.env, "OMP_NUM_THREADS": "1"})
    sub = subprocess.run(
        rank_launch_cmd(1, K2_SUBMIT, [*job_args, f"run.dir={run_dir}"]),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().splitlines()[0]


def _requeue_and_start(slurm, job: str, restarts: int, log) -> None:
    """Requeue ``job`` (its ``restarts``-th restart) and start it again at once."""
    slurm.scontrol("requeue", job)
    slurm.restart_now(job, restarts, log)


def _kill_run(run_dir) -> None:
    """SIGKILL every process of the run in ``run_dir`` (k2-train and its ranks), as when a node is lost."""
    for proc in psutil.process_iter(["cmdline"]):
        if f"run.dir={run_dir}" in " ".join(proc.info["cmdline"] or ()):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def test_sbatch_job_killed_before_its_first_save_then_requeued_mid_run_has_the_uninterrupted_loss(
    slurm, tmp_path, stdlib_corpus
):
    """One job through two faults, against an uninterrupted run:

    * every process of the job gets SIGKILL (a node lost) after its first step and before its first
      checkpoint (``train.save_interval=8``: the only periodic save is the last step's); the job,
      requeued, starts the run afresh in the same run dir (it is not refused for holding metrics without
      a checkpoint);
    * then it is requeued mid-run with ``scontrol requeue`` (SIGTERM to every process of the step,
      wandb's service included): the ranks save the step in progress and exit 42, and the job resumes
      from that checkpoint without re-running a step;
    * it finishes with the losses of the uninterrupted run, bit for bit, and counts the steps the kill
      threw away as replayed time.

    (One job for both faults: each start of the job costs every rank a fresh interpreter.)"""
    run_dir = tmp_path / "run"
    job_args = [*[x for x in JOB if not x.startswith("train.save_interval")], "train.save_interval=8"]
    job = _submit(slurm, job_args, run_dir)
    metrics = run_dir / "metrics.jsonl"

    def steps_logged() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def log(tail: int = 4000) -> str:
        f = run_dir / f"slurm-{job}.out"
        return f.read_text()[-tail:] if f.exists() else "(no log)"

    try:
        _wait(lambda: steps_logged() >= 1, 300, lambda: f"step 1 of job {job}: {log()}")
        _kill_run(run_dir)
        _wait(
            lambda: slurm.job_field(job, "JobState") not in ("RUNNING", "COMPLETING"),
            120,
            lambda: f"job {job} to die: {log()}",
            every=0.5,
        )
        assert not (run_dir / "checkpoints" / "latest").exists(), "killed after its first save: retry"
        _requeue_and_start(slurm, job, 1, log)
        # (the restart sets the killed run's records aside before it says so: metrics.jsonl is then its own)
        _wait(
            lambda: "killed before its first checkpoint" in log(tail=10**7) and steps_logged() >= 3,
            300,
            lambda: f"step 3 of job {job} after its fresh start: {log()}",
        )
        _requeue_and_start(slurm, job, 2, log)  # every process of the step gets SIGTERM: the ranks save, exit 42
        _wait(
            lambda: slurm.job_field(job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED"),
            600,
            lambda: f"job {job} to finish: {log()}",
            every=1,
        )
    finally:
        if slurm.job_field(job, "JobState") in ("RUNNING", "PENDING"):
            subprocess.run(["scancel", job], env=slurm.env)
    assert slurm.job_field(job, "JobState") == "COMPLETED", log() + slurm.diagnose(job)
    assert slurm.job_field(job, "Restarts") == "2", log()
    assert slurm.job_field(job, "Comment") == "k2-slurm-options" and slurm.job_field(job, "CPUs/Task") == "1"
    script = (run_dir / "pretrain.sbatch").read_text().splitlines()
    assert {"#SBATCH --mem=0", "#SBATCH --cpus-per-task=1"} <= set(script), script
    out = log(tail=10**7)
    assert all(f"restart {n}" in out for n in range(3)), out[-4000:]
    assert "killed before its first checkpoint" in out, out[-4000:]
    assert f"resumed from {run_dir / 'checkpoints'}" in out, out[-4000:]
    # the SIGTERM of the requeue was turned into a checkpoint of the step in progress, so nothing was
    # re-run after the restart; wandb dying of the step's SIGTERM cost nothing
    assert "SIGTERM received" in out and out.count("preempted: signal") == 1, out[-4000:]
    assert "are re-run" not in out, out[-4000:]

    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 9))
    ref = run_trainer([x for x in job_args if not x.startswith(("cluster.", "submit."))], 2, tmp_path / "ref")
    assert [(r["loss"], r["grad_norm"]) for r in recs] == [(r["loss"], r["grad_norm"]) for r in ref]
    assert json.loads((run_dir / "checkpoints" / "iter_0000008" / "k2_state.json").read_text())["step"] == 8
    assert recs[-1]["time_replayed_s"] > 0 and recs[-1]["goodput"] < 1


def test_a_two_arm_two_budget_grid_submits_its_branches_after_their_trunks(slurm, tmp_path, stdlib_corpus):
    """`k2-submit -m` submits a 2-arm x 2-budget grid as 2 trunk jobs and 4 branch jobs, each branch with
    --dependency=afterok on its trunk's job: every branch starts after its trunk has ended (with its branch
    points saved); k2-sweep-report reads the result; a second submission of the finished grid submits
    nothing."""
    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        "+experiment=sparsity_sweep",
        "sweep.sparsities=[1,4]",
        "sweep.seeds=[1]",
        "sweep.budgets_tokens=[10240,20480]",
        "schedule.global_batch_tokens=2048",
        "train.micro_batch_size=2",
        "schedule.phases.0.steps=2",
        "train.eval_interval=1000",
        "train.eval_iters=1",
        "train.progress=false",
        "run.wandb.mode=disabled",
        "model.vocab_size=4096",
        "data.vocab_size=4096",
        "cluster.nodes=1",
        "cluster.gpus_per_node=1",
        "submit.request_gpus=false",
        "submit.time=30",
        "submit.cpus_per_task=1",
        # (what this test checks is the order of the jobs and their results, not how Slurm signals a
        # job's processes: each job's python is the fork server's, so its one rank skips the import)
        f"submit.python={fork_server_python(tmp_path)}",
        f"sweep.dir={sweep_dir}",
    ]
    env = trainer_env({**slurm.env, "OMP_NUM_THREADS": "1"})
    submit = rank_launch_cmd(1, K2_SUBMIT, args)
    sub = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert sub.returncode == 0, sub.stderr
    assert "GPU-hours as trunks + cooldown branches" in sub.stderr, sub.stderr  # k2-plan's check came first
    jobs = sub.stdout.split()
    assert len(jobs) == 6, sub.stdout  # per arm: the trunk, then its two branches
    _wait(
        lambda: all(slurm.job_field(j, "JobState") in ("COMPLETED", "FAILED", "CANCELLED") for j in jobs),
        900,
        lambda: f"jobs {jobs}: " + " ".join(slurm.job_field(j, "JobState") for j in jobs),
        every=1,
    )
    assert [slurm.job_field(j, "JobState") for j in jobs] == ["COMPLETED"] * 6, [slurm.diagnose(j) for j in jobs]
    for arm in (0, 1):
        trunk, branches = jobs[3 * arm], jobs[3 * arm + 1 : 3 * arm + 3]
        for b in branches:
            assert slurm.job_field(b, "StartTime") >= slurm.job_field(trunk, "EndTime"), (b, trunk)
    for s in (1, 4):
        trunk_dir = sweep_dir / f"sparsity_{s}" / "seed_1" / "trunk"
        for budget, step in ((10240, 4), (20480, 8)):
            cell = sweep_dir / f"sparsity_{s}" / "seed_1" / f"budget_{budget}"
            assert json.loads((cell / "branch.json").read_text())["trunk_step"] == step
            assert (trunk_dir / "checkpoints" / f"iter_{step:07d}").is_dir()
            assert [json.loads(x)["step"] for x in (cell / "metrics.jsonl").read_text().splitlines()] == list(
                range(0, budget // 2048 + 1)
            )
    rep = subprocess.run(
        [sys.executable, "-c", "from k2.launcher.sweep_report import cli; cli()", str(sweep_dir)],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rep.returncode == 0, rep.stderr
    cells = json.loads((sweep_dir / "sweep.json").read_text())["cells"]
    assert len(cells) == 4 and all(c["status"] == "finished" for c in cells), cells
    again = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.strip() == "", again.stdout + again.stderr
    assert again.stderr.count("every branch finished, not submitted") == 2
