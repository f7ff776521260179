"""Helpers for multi-process tests: run the real trainer under torchrun (gloo) and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from support import REPO, SCRIPTS, free_port

#: added to every run_trainer launch unless the test sets the key: no wandb, no progress bar, and one
#: validation batch per evaluation (a test compares runs made with the same setting; at the recipe's
#: four, the evaluations before and after training cost more CPU than a short run's steps)
QUIET = ["run.wandb.mode=disabled", "train.progress=false", "train.eval_iters=1"]
SUPPORT = Path(__file__).resolve().parent
#: the session's fork server socket (set by the ``fork_server`` fixture of tests/conftest.py)
FORK_SERVER_ENV = "K2_TEST_FORK_SERVER"


def trainer_env(extra: dict | None = None) -> dict:
    """This process's environment without any launcher's rank/rendezvous variables (torchrun, Slurm,
    k2-train's own), so that a trainer started from a test decides them itself (a lone process picks
    a free port), with one OpenMP thread per rank."""
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "K2_SPAWNED")  # (the
    # fork server's socket stays: a test script's own launches may use it)
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars and not k.startswith("SLURM_")}
    env.update({"OMP_NUM_THREADS": "1", **(extra or {})})
    return env


def rank_launch_cmd(nproc: int, target: list[str], args: list[str]) -> list[str]:
    """Command that runs ``target`` (``["-m", module]``, ``["-c", code]`` or ``[script]``) with ``args`` on
    ``nproc`` local gloo ranks (one plain process for one rank). By default the launch is forked by the session's fork
    server (tests/support/zygote.py: torch and megatron-core imported once per session); with
    ``K2_TEST_LAUNCHER=fork`` the ranks are forked from one fresh interpreter per launch
    (k2.launcher.training.fork_ranks, what k2-train itself runs), with ``K2_TEST_LAUNCHER=torchrun``
    torchrun starts them."""
    mode = os.environ.get("K2_TEST_LAUNCHER", "server")
    server = os.environ.get(FORK_SERVER_ENV)
    if mode == "server" and server:
        return [sys.executable, str(SUPPORT / "zygote_client.py"), server, str(nproc), *target, *args]
    if nproc == 1:
        return [sys.executable, *target, *args]
    if mode == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            *target,
            *args,
        ]
    return [sys.executable, "-m", "k2.launcher.training.fork_ranks", str(nproc), *target, *args]


#: ``k2-submit`` as a launch target (:func:`rank_launch_cmd`): forked by the fork server, a submission
#: skips the ~4 CPU-s import of torch and megatron-core that its plan check needs
K2_SUBMIT = ["-c", "from k2.launcher.submit import cli; cli()"]


def fork_server_python(directory: Path) -> str:
    """A ``python`` for a shell script that the tests run (``$PYTHON`` of benchmarks/gpu_session.sh, a Slurm
    job's ``submit.python``): ``python ARGS`` as a one-process launch of the session's fork server (no rank
    environment: the process keeps the one it was given), written as ``directory/python``, so that each
    start skips a fresh interpreter's ~5-7 CPU-s import of torch and megatron-core; the module or script
    still runs afresh as ``__main__`` in a process of its own (the children it starts itself stay fresh
    interpreters). Without a fork server (``K2_TEST_LAUNCHER=fork|torchrun``): this interpreter."""
    import shlex

    server = os.environ.get(FORK_SERVER_ENV)
    if not server:
        return sys.executable
    wrapper = Path(directory) / "python"
    client = [sys.executable, str(SUPPORT / "zygote_client.py"), server, "1"]
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.join(client)} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def start_processes_forked(
    fn, args=(), nprocs: int = 1, join: bool = True, start_method: str = "spawn", **_ignored
) -> None:
    """A stand-in for ``torch.multiprocessing.start_processes`` / ``spawn`` (patched in or called by tests of
    code that spawns its ranks, e.g. k2-bench's bench=memory and bench=optimizer): the ``nprocs`` processes
    run ``fn(rank, *args)`` as one launch of :func:`rank_launch_cmd` (the session's fork server) instead of
    ``nprocs`` fresh interpreters that each import torch and megatron-core again
    (tests/support/scripts/rank_function.py). As with ``spawn``, ``fn`` is imported by its module and name
    (with this process's ``sys.path``: a test module's own function works too) and ``args`` are pickled.
    Always joins (``join`` and ``start_method`` are accepted and ignored). Raises AssertionError with the
    output's tail when a process fails."""
    import pickle

    call = pickle.dumps((sys.path, fn.__module__, fn.__qualname__, tuple(args))).hex()
    cmd = rank_launch_cmd(nprocs, [str(SCRIPTS / "rank_function.py")], [call])
    proc = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (
        f"{fn.__qualname__} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def run_trainer(
    overrides: list[str],
    nproc: int,
    run_dir: Path,
    script: str | None = None,
    timeout: int = 600,
    env: dict | None = None,
    expect_failure: bool = False,
    stdout_to: Path | None = None,
    stderr_to: Path | None = None,
) -> list[dict]:
    """Run ``k2.launcher.train`` (or a test script wrapping it) on ``nproc`` gloo ranks; return the
    metrics.jsonl records of the training steps (step >= 1; the ``"step": 0`` record of the evaluation
    before training is left out: read metrics.jsonl for it). :data:`QUIET` is added except for the keys
    ``overrides`` sets (e.g. ``run.wandb.mode=offline``). Raises AssertionError with the tail of the
    output on failure or timeout
    (a hang shows up as a timeout), or, with ``expect_failure``, when the run exits with status 0."""
    target = ["-m", "k2.launcher.train"] if script is None else [str(SCRIPTS / script)]
    quiet = [q for q in QUIET if not any(o.startswith(q.split("=")[0] + "=") for o in overrides)]
    args = [*overrides, *quiet, f"run.dir={run_dir}", f"launch.nproc_per_node={nproc}"]
    cmd = rank_launch_cmd(nproc, target, args)
    full_env = trainer_env(env)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"trainer timed out after {timeout}s (hang?): {' '.join(cmd)}\n"
            f"{(e.stdout or '')[-3000:]}{(e.stderr or '')[-3000:]}"
        ) from None
    if stdout_to is not None:  # for tests of what the run prints
        Path(stdout_to).write_text(proc.stdout)
    if stderr_to is not None:
        Path(stderr_to).write_text(proc.stderr)
    if expect_failure:
        assert proc.returncode != 0, f"trainer did not fail: {' '.join(cmd)}\n{proc.stdout[-3000:]}"
    else:
        assert proc.returncode == 0, (
            f"trainer failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    path = run_dir / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] > 0]


# schedule.phases.0.steps=0: the stable LR 3e-3 from step 1, so steps 2-3 see updated weights
THREE_STEPS = [
    "train.iters=3",
    "train.eval_interval=0",
    "schedule.phases.0.steps=0",
    "run.seed=7",
    "checkpoint.save_at_end=false",
]

# MuonClip with Newton-Schulz in fp32 (so that runs at different DP sizes compare to fp32 tolerance, see
# tests/integration/test_muonclip_parallel.py) and model.ffn_hidden_size=320 (megatron's byte-range ZeRO-1 at DP=2
# would cut layer 2's linear_kv_up_proj): the MuonClip runs of three_step_run
MUONCLIP_FP32 = ["optim=muonclip", "optim.muon_fp32_matmul_prec=highest", "model.ffn_hidden_size=320"]


def three_step_run(root: Path, layout: list[str], nproc: int, decouple_wgrad: bool, cache: dict) -> dict:
    """3 optimizer steps of the trainer (THREE_STEPS) with the pipeline trace and a dump of every rank's
    gradients per step and final parameters (tests/support/scripts/dump_params_train.py). Runs that several
    test files need (e.g. cpu4 with memory=none/k2 and the wgrad split off) run once per test session,
    also when the session is spread over xdist workers: ``root`` is shared by the workers, each run has a
    directory named after its arguments, made by the first worker that needs it (under a file lock) and
    read by the others; ``cache`` keeps what this process has read.

    Returns:
        ``{"records": metrics.jsonl records, "traces": {rank: events}, "dumps": {rank: (grads, params)},
        "dump_dir": the script's output directory (also ``layout_rank<R>.json``)}``.
    """
    import hashlib

    from k2.launcher.datasets.locks import file_lock

    key = (tuple(layout), nproc, decouple_wgrad)
    if key in cache:
        return cache[key]
    out = root / hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(str(root / f"{out.name}.lock")):
        if not (out / "done").exists():
            if out.exists():  # a run that failed half-way in another worker
                import shutil

                shutil.rmtree(out)
            run_trainer(
                [
                    *layout,
                    *THREE_STEPS,
                    f"pipeline.decouple_wgrad={str(decouple_wgrad).lower()}",
                    f"pipeline.trace={out / 'trace'}",
                ],
                nproc,
                out / "run",
                script="dump_params_train.py",
                env={"K2_TEST_OUT": str(out / "dump"), "K2_DUMP_GRADS": "1"},
            )
            (out / "done").write_text(repr(key) + "\n")
    recs = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    traces = {}
    for path in sorted((out / "trace").glob("rank*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines()]
        traces[events[0]["rank"]] = events
    dumps = {
        r: (torch.load(out / "dump" / f"grads_rank{r}.pt"), torch.load(out / "dump" / f"params_rank{r}.pt"))
        for r in range(nproc)
    }
    cache[key] = {"records": recs, "traces": traces, "dumps": dumps, "dump_dir": out / "dump"}
    return cache[key]
