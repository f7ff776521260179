"""``k2-bench bench=checkpoint``: how long the training loop waits for a save, with
``checkpoint.async_save`` off and on, and how much slower the steps are that overlap a background write.

Both configurations are real one-rank ``k2-train`` runs (the same settings, one after the other in
one benchmark run) of a model whose checkpoint is about ``1.2 GB`` by default: ``k2_tiny`` with
``moe_experts`` experts of width ``moe_ffn`` (experts hold the bytes; only the top-k run per token, so
a step stays short), AdamW (a checkpoint holds the parameters and the optimizer's copy and two moments:
16 bytes per parameter in FP32). A save every ``save_interval`` steps, none at the end.

Figures (``metrics.jsonl``): ``checkpoint_bytes`` (of one checkpoint); ``stalls_sync_s`` /
``stalls_async_s``, the loop's checkpoint time per periodic save (:func:`per_save_stalls`: writing and
hashing for sync; staging, and the commit at a later step, for async); ``stall_sync_s`` /
``stall_async_s`` and their ratio ``async_over_sync``: the mean over the saves from the third on, the
steady state of a long run (a process's first save also checks the sharding, and its first two plan
the save in full before megatron's cached plans apply: ``first_saves_async_over_sync``, the same ratio
over those two); ``step_s`` (median step of the sync run, the first left out), ``overlapped_step_s``
(median step of the async run while a write is in flight, ``checkpoint_in_flight``) and their ratio
``overlapped_slowdown``; ``background_write_s`` (staging to commit, from the async run's log).
Published stalls for comparison: 148.8 s -> 6.3 s for a 7B model (megatron-core async
dist-checkpointing), 0.78 s for Llama-3-70B on 1,856 GPUs (torchtitan).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.config.recipes import repo_root
from k2.launcher.benchmarks.common import bench_options
from k2.parallel.processes import child_env

if TYPE_CHECKING:
    from k2.config.schema import K2Config

_DEFAULTS = {
    "moe_experts": 64,  # experts per MoE layer (k2_tiny: 8)
    "moe_ffn": 1024,  # expert width (k2_tiny: 64): ~75 M parameters, ~1.2 GB per checkpoint
    "iters": 20,  # steps per run (a multiple of save_interval)
    "save_interval": 4,  # a save every N steps: four timed, two of them in the steady state
    "timeout": 1800,  # seconds per run
}


def _run(o: dict, async_save: bool, run_dir: Path) -> tuple[list[dict], str]:
    overrides = [
        "model=k2_tiny",
        f"model.num_moe_experts={o['moe_experts']}",
        f"model.moe_ffn_hidden_size={o['moe_ffn']}",
        "optim=adamw",
        f"train.iters={o['iters']}",
        f"train.save_interval={o['save_interval']}",
        "train.eval_interval=0",
        "checkpoint.save_at_end=false",
        f"checkpoint.keep_last={o['iters']}",
        f"checkpoint.async_save={str(async_save).lower()}",
        "run.wandb.mode=disabled",
        "train.progress=false",
        "launch.nproc_per_node=1",
        f"run.dir={run_dir}",
    ]
    cmd = [sys.executable, "-m", "k2.launcher.train", *overrides]
    proc = subprocess.run(cmd, cwd=repo_root(), env=child_env(), capture_output=True, text=True, timeout=o["timeout"])
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench=checkpoint: trainer failed ({proc.returncode}): {' '.join(cmd)}\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("step", 0) > 0], proc.stdout


def per_save_stalls(recs: list[dict], interval: int, iters: int) -> list[float]:
    """Seconds the loop spent on each periodic save but the last (at step ``iters``, which the end of
    the run waits for): the growth of ``time_checkpoint_s`` (cumulative, in each step's record, which is
    written before that step's save) from the save's step to the next save's step, so a background
    save's commit, made at a later step, counts with its own save. ``recs``: the run's step records
    (steps 1..``iters``)."""
    cum = {r["step"]: r.get("time_checkpoint_s", 0.0) for r in recs}
    steps = list(range(interval, iters + 1, interval))
    return [cum[b] - cum[a] for a, b in zip(steps, steps[1:])]


def bench_checkpoint(cfg: K2Config) -> dict[str, Any]:
    """Save stall with ``checkpoint.async_save`` off and on, and the slowdown of overlapped steps, in
    one benchmark run (module docstring).

    Raises:
        ConfigError: a bad option.
    """
    o = bench_options(cfg, _DEFAULTS)
    for key in ("moe_experts", "moe_ffn", "save_interval", "timeout"):
        if o[key] < 1:
            raise ConfigError(f"bench.options.{key}={o[key]} must be >= 1")
    if o["iters"] < 4 * o["save_interval"] or o["iters"] % o["save_interval"]:
        raise ConfigError(
            f"bench.options.iters={o['iters']} must be a multiple of bench.options.save_interval "
            f"({o['save_interval']}) and >= {4 * o['save_interval']}: three timed saves and a "
            f"last one"
        )
    with tempfile.TemporaryDirectory(prefix="k2-bench-ckpt-") as tmp:
        sync, _ = _run(o, False, Path(tmp) / "sync")
        ckpt = Path(tmp) / "sync" / "checkpoints" / f"iter_{o['save_interval']:07d}"
        size = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
        asyn, log = _run(o, True, Path(tmp) / "async")
    stalls_sync = per_save_stalls(sync, o["save_interval"], o["iters"])
    stalls_async = per_save_stalls(asyn, o["save_interval"], o["iters"])
    stall_sync, stall_async = statistics.mean(stalls_sync[2:]), statistics.mean(stalls_async[2:])
    step = statistics.median(r["step_time_s"] for r in sync[1:])
    overlapped = [r["step_time_s"] for r in asyn if r.get("checkpoint_in_flight")]
    writes = [float(x) for x in re.findall(r"checkpoint \S+ \(train.save_interval, ([\d.]+) s\)", log)]
    return {
        "checkpoint_bytes": size,
        "stalls_sync_s": [round(x, 3) for x in stalls_sync],
        "stalls_async_s": [round(x, 3) for x in stalls_async],
        "stall_sync_s": stall_sync,
        "stall_async_s": stall_async,
        "async_over_sync": stall_async / stall_sync,
        "first_saves_async_over_sync": statistics.mean(stalls_async[:2]) / statistics.mean(stalls_sync[:2]),
        "step_s": step,
        "overlapped_steps": len(overlapped),
        "overlapped_step_s": statistics.median(overlapped) if overlapped else None,
        "overlapped_slowdown": statistics.median(overlapped) / step if overlapped else None,
        "background_write_s": statistics.median(writes) if writes else None,
        "same_losses": [r["loss"] for r in sync] == [r["loss"] for r in asyn],
    }
