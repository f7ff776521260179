"""``k2-bench``: micro-benchmarks of the launcher's own components, on CPU and (when present) CUDA.

Usage::

    k2-bench                                   # bench=none: list the benchmarks
    k2-bench bench=attention                   # figures as a table
    k2-bench bench=attention output=json       # one JSON object on stdout
    k2-bench bench=attention bench.options.seq_length=512
    k2-bench bench=optimizer                   # MuonClip vs AdamW optimizer step, CPU proxy
    k2-bench bench=pipeline                    # decoupled wgrad on vs off: step time, cpu4
    k2-bench bench=memory                      # saved bytes / step time: memory none|fp8|recompute|offload|all
    k2-bench bench=step                        # full K2 step vs plain megatron-core, each feature toggled
    k2-bench bench=hf_convert                  # k2-convert import/export peak RSS vs largest group / model
    k2-bench bench=data                        # k2-data prepare tokens/s vs raw encode_batch; peak RSS
    k2-bench bench=hardware bench.options.out=PATH.yaml   # this machine's profile for k2-plan plan.hardware=
    k2-bench bench=perf_model                  # k2-plan's step time vs measured single / pp2 runs
    k2-bench bench=checkpoint                  # save stall, checkpoint.async_save off vs on; overlapped steps
    k2-bench bench=ep_overlap                  # pipeline.ep_overlap off vs on across a shaped link (root)

The registry (:data:`BENCHMARKS`). ``bench=<name>`` picks a recipe in ``recipes/bench/`` whose ``name`` selects
a function of :data:`BENCHMARKS` (name -> ``function(cfg) -> dict of figures``); ``bench.options.*`` are that
benchmark's options (defaults in the recipe and in the function; an unknown option or a bad value is a
:class:`k2.config.ConfigError`: ``k2-bench: error: ...``, exit status 2).

JSON output: ``{"bench": name, "system": {...}, "options": {...}, "figures": {...}}`` with ``system`` =
torch and megatron-core versions, Python, device name, CPU count, torch threads, CUDA/cuDNN versions.
Times are milliseconds (median of ``repeats`` timed calls after ``warmup`` untimed ones; CUDA timed with
``torch.cuda.synchronize`` around each call).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.launcher.benchmarks.activation_memory import bench_memory
from k2.launcher.benchmarks.attention import bench_attention
from k2.launcher.benchmarks.common import describe, system_info
from k2.launcher.benchmarks.data_prepare import bench_data
from k2.launcher.benchmarks.optimizer import bench_optimizer

if TYPE_CHECKING:
    from k2.config.schema import K2Config


def bench_step(cfg: K2Config) -> dict[str, Any]:
    """One K2 training step vs a plain megatron-core step, each K2 feature toggled off (one process)."""
    from k2.launcher.benchmarks.step import bench_step as run

    return run(cfg)


def bench_pipeline(cfg: K2Config) -> dict[str, Any]:
    """Step time with decoupled weight gradients (pipeline.decouple_wgrad) on vs off, in one run."""
    from k2.launcher.benchmarks.pipeline import bench_pipeline as run

    return run(cfg)


def bench_hf_convert(cfg: K2Config) -> dict[str, Any]:
    """Peak host memory of k2-convert import / export against the largest tensor group and the model."""
    from k2.launcher.benchmarks.hf_convert import bench_hf_convert as run

    return run(cfg)


def bench_hardware(cfg: K2Config) -> dict[str, Any]:
    """This machine's hardware profile for k2-plan's step-time model (GEMM rate by shape, memory bandwidth,
    per-operator cost, the backend's collectives); bench.options.out=PATH.yaml writes it."""
    from k2.launcher.benchmarks.hardware import bench_hardware as run

    return run(cfg)


def bench_perf_model(cfg: K2Config) -> dict[str, Any]:
    """k2-plan's step-time model against measured parallel=single and parallel=pp2 runs of the main job's
    model, on a profile measured in the same run: predicted / measured per component."""
    from k2.launcher.benchmarks.perf_model import bench_perf_model as run

    return run(cfg)


def bench_ep_overlap(cfg: K2Config) -> dict[str, Any]:
    """pipeline.ep_overlap off vs on with EP across two network namespaces joined by a tc-tbf-shaped link:
    step time, exposed all-to-all time, and k2-plan's prediction of both for that link (needs root)."""
    from k2.launcher.benchmarks.ep_overlap import bench_ep_overlap as run

    return run(cfg)


def bench_checkpoint(cfg: K2Config) -> dict[str, Any]:
    """The loop's wait per save with checkpoint.async_save off and on, and the slowdown of overlapped steps."""
    from k2.launcher.benchmarks.checkpoint import bench_checkpoint as run

    return run(cfg)


#: name -> function(cfg) -> dict of figures (nested dicts = one section per case).
BENCHMARKS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "attention": bench_attention,
    "optimizer": bench_optimizer,
    "pipeline": bench_pipeline,  # k2.launcher.benchmarks.pipeline
    "ep_overlap": bench_ep_overlap,  # k2.launcher.benchmarks.ep_overlap
    "memory": bench_memory,
    "step": bench_step,  # k2.launcher.benchmarks.step
    "hf_convert": bench_hf_convert,  # k2.launcher.benchmarks.hf_convert
    "data": bench_data,  # k2.launcher.benchmarks.data_prepare
    "hardware": bench_hardware,  # k2.launcher.benchmarks.hardware
    "perf_model": bench_perf_model,  # k2.launcher.benchmarks.perf_model
    "checkpoint": bench_checkpoint,  # k2.launcher.benchmarks.checkpoint
}


def run_bench(cfg: K2Config) -> dict[str, Any]:
    """The JSON record of ``cfg.bench.name`` (``none``: the list of benchmarks).

    Raises:
        ConfigError: unknown benchmark name or a bad option.
    """
    name = cfg.bench.name
    if name == "none":
        return {"bench": "none", "available": {k: describe(fn) for k, fn in BENCHMARKS.items()}}
    if name not in BENCHMARKS:
        raise ConfigError(f"bench.name={name!r}; available: none, {', '.join(BENCHMARKS)}")
    with warnings.catch_warnings():  # importing megatron warns about the missing TE/Apex
        warnings.simplefilter("ignore")
        figures = BENCHMARKS[name](cfg)
    options = cfg.bench.options
    from omegaconf import OmegaConf

    return {
        "bench": name,
        "system": system_info(),
        "options": OmegaConf.to_container(options) if options is not None else None,
        "figures": figures,
    }
