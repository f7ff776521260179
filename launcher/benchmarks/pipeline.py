"""``k2-bench bench=pipeline``: step time with decoupled weight gradients (``pipeline.decouple_wgrad``) on
against off, in one benchmark run.

Each configuration is a real ``k2-train`` run (``nproc`` local ranks, started by k2-train itself; on a
CPU-only machine gloo, the CPU proxy) of ``iters`` steps at the stable LR; the runs alternate off, on,
off, on, ... for ``rounds`` rounds so that a drift of the machine hits both alike. The figure is the median
``step_time_s`` (``metrics.jsonl``) over all steps but the first of each run, and, less sensitive to other
load on a shared machine, the CPU seconds of the forward-backward pass summed over the ranks (both runs
write a ``pipeline.trace``, whose ``end`` events carry them). On gloo/CPU no gain is
expected (the p2p transfers are host copies that do not overlap with compute the way NCCL transfers on a
side stream do); the point is that the split costs little. With ``devices=auto`` and at least ``nproc``
CUDA devices the same pair of runs is repeated on GPU (NCCL).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.config.recipes import repo_root
from k2.launcher.benchmarks.common import bench_options
from k2.launcher.training.prepare import prepare_run
from k2.parallel.processes import child_env
from k2.schedules.pipeline import read_trace

if TYPE_CHECKING:
    from k2.config.schema import K2Config

_DEFAULTS = {
    "parallel": "cpu4",  # a parallel recipe (PP with VPP: K2's interleaved 1F1B)
    "nproc": 4,  # local ranks
    "model": "k2_tiny",
    "iters": 6,  # optimizer steps per run (the first is not timed)
    "rounds": 1,  # off/on pairs
    "devices": "auto",  # auto (cpu, plus cuda with >= nproc GPUs) | cpu | cuda
    "timeout": 1200,  # seconds per run
}


def trainer_command(overrides: list[str], nproc: int) -> list[str]:
    """The command line of one configuration's run: ``k2-train`` with ``overrides`` (which set
    ``launch.nproc_per_node=nproc``: k2-train forks its ``nproc`` local ranks itself). A module-level
    function so that a caller that launches trainers its own way (the tests' fork server) can replace it."""
    return [sys.executable, "-m", "k2.launcher.train", *overrides]


def _run(o: dict, decouple: bool, run_dir: Path, cuda: bool) -> list[dict]:
    overrides = [
        f"parallel={o['parallel']}",
        f"model={o['model']}",
        f"launch.nproc_per_node={o['nproc']}",
        f"train.iters={o['iters']}",
        "train.eval_interval=0",
        "schedule.phases.0.steps=0",
        "checkpoint.save_at_end=false",
        "run.wandb.mode=disabled",
        "train.progress=false",
        f"run.dir={run_dir}",
        f"pipeline.decouple_wgrad={str(decouple).lower()}",
        f"pipeline.trace={run_dir / 'trace'}",  # for the CPU seconds per pass (both configurations)
    ]
    cmd = trainer_command(overrides, o["nproc"])
    env = child_env(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // o["nproc"])))
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, cwd=repo_root(), env=env, capture_output=True, text=True, timeout=o["timeout"])
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench=pipeline: trainer failed ({proc.returncode}): {' '.join(cmd)}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    cpu: dict[int, float] = {}  # step -> CPU seconds of the training pass, summed over the ranks
    for events in read_trace(str(run_dir / "trace")).values():
        for e in events:
            if e["kind"] == "end" and e["pass"] == "train":
                cpu[e["step"]] = cpu.get(e["step"], 0.0) + e["cpu_s"]
    for rec in recs:
        rec["pass_cpu_s"] = cpu[rec["step"]]
    return recs


def _case(o: dict, cuda: bool, tmp: Path) -> dict[str, Any]:
    times: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, list[float]] = {}
    peak = 0
    for r in range(o["rounds"]):
        for decouple in (False, True):
            recs = _run(o, decouple, tmp / f"{'cuda' if cuda else 'cpu'}-r{r}-{int(decouple)}", cuda)
            times[decouple] += [rec["step_time_s"] for rec in recs[1:]]
            cpu[decouple] += [rec["pass_cpu_s"] for rec in recs[1:]]
            losses[decouple] = [rec["loss"] for rec in recs]
            if decouple:
                peak = max(peak, max(rec.get("wgrad_deferred_peak_bytes", 0) for rec in recs))
    off, on = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
    off_min, on_min = min(times[False]) * 1e3, min(times[True]) * 1e3
    return {
        "parallel": o["parallel"],
        "ranks": o["nproc"],
        "timed_steps_per_config": len(times[False]),
        "step_time_off_ms": off,
        "step_time_on_ms": on,
        "on_over_off": on / off,
        # the fastest step of each: less sensitive to other load on a shared machine
        "fastest_step_off_ms": off_min,
        "fastest_step_on_ms": on_min,
        "fastest_on_over_off": on_min / off_min,
        # CPU seconds of a step's forward-backward pass summed over the ranks (what other load on the
        # machine changes least)
        "pass_cpu_s_off": statistics.median(cpu[False]),
        "pass_cpu_s_on": statistics.median(cpu[True]),
        "pass_cpu_on_over_off": statistics.median(cpu[True]) / statistics.median(cpu[False]),
        "max_loss_rel_diff": max(abs(a - b) / abs(a) for a, b in zip(losses[False], losses[True])),
        "wgrad_deferred_peak_bytes": peak,
    }


def bench_pipeline(cfg: K2Config) -> dict[str, Any]:
    """Step time with decoupled weight gradients on vs off (``pipeline.decouple_wgrad``), CPU and GPU.

    Figures per case (``cpu``; ``cuda`` when at least ``nproc`` GPUs are present): ``step_time_off_ms``,
    ``step_time_on_ms`` (medians over the timed steps of all rounds), ``on_over_off`` (ratio), the same
    for the fastest step of each (``fastest_*``: less sensitive to other load on a shared machine),
    ``pass_cpu_s_off`` / ``_on`` (CPU seconds of the forward-backward pass summed over the ranks, from the
    ``pipeline.trace`` both runs write) and their ratio,
    ``max_loss_rel_diff`` (the per-step losses of the two runs; 0 = identical training),
    ``wgrad_deferred_peak_bytes`` (most bytes of deferred wgrad inputs held at once on any rank).

    Raises:
        ConfigError: a bad option.
    """
    import torch

    o = bench_options(cfg, _DEFAULTS)
    if o["devices"] not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"bench.options.devices={o['devices']!r}; allowed: auto, cpu, cuda")
    for key in ("nproc", "iters", "rounds", "timeout"):
        if o[key] < (2 if key == "iters" else 1):
            raise ConfigError(f"bench.options.{key}={o[key]} must be >= {2 if key == 'iters' else 1}")
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if o["devices"] == "cuda" and n_gpu < o["nproc"]:
        raise ConfigError(
            f"bench.options.devices=cuda needs bench.options.nproc={o['nproc']} GPUs, "
            f"{n_gpu} present; allowed: auto, cpu"
        )

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="k2-bench-pipeline-") as tmp:
        # the run must be valid before anything starts (one ConfigError, as k2-train would give)
        run_cfg = load_config(
            [
                f"parallel={o['parallel']}",
                f"model={o['model']}",
                f"launch.nproc_per_node={o['nproc']}",
                f"train.iters={o['iters']}",
                f"run.dir={tmp}/check",
            ]
        )
        prepare_run(run_cfg, o["nproc"])
        if run_cfg.data.path is None:
            from k2.launcher.datasets.corpus import prepare_stdlib_corpus

            prepare_stdlib_corpus(run_cfg.data, progress=False, verbose=False)
        if o["devices"] in ("auto", "cpu"):
            figures["cpu"] = _case(o, False, Path(tmp))
        if o["devices"] in ("auto", "cuda"):
            if n_gpu >= o["nproc"]:
                figures["cuda"] = _case(o, True, Path(tmp))
            else:
                figures["cuda"] = {"skipped": f"{n_gpu} CUDA devices, {o['nproc']} ranks needed"}
    return figures
