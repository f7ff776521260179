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
    k2-bench bench=host_cost                   # the host's time per operator of the layers' code (k2-plan's host term)
    k2-bench bench=checkpoint                  # save stall, checkpoint.async_save off vs on; overlapped steps
    k2-bench bench=ep_overlap                  # pipeline.ep_overlap off vs on across a shaped link (root)

The registry (:data:`BENCHMARKS`). ``bench=<name>`` picks a recipe in ``recipes/bench/`` whose ``name`` selects
the function ``bench_<name>(cfg) -> dict of figures`` of the module :data:`BENCHMARKS` names;
``bench.options.*`` are that benchmark's options (defaults in the recipe and in the function; an unknown
option or a bad value is a :class:`k2.config.ConfigError`: ``k2-bench: error: ...``, exit status 2).

JSON output: ``{"bench": name, "system": {...}, "options": {...}, "figures": {...}}`` with ``system`` =
torch and megatron-core versions, Python, device name, CPU count, torch threads, CUDA/cuDNN versions.
Times are milliseconds (median of ``repeats`` timed calls after ``warmup`` untimed ones; CUDA timed with
``torch.cuda.synchronize`` around each call).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.launcher.benchmarks.common import describe, system_info

if TYPE_CHECKING:
    from k2.config.schema import K2Config

#: ``bench.name`` -> the module of this package that defines its function ``bench_<name>(cfg) -> dict of
#: figures`` (nested dicts = one section per case). A module is imported when its benchmark is first
#: looked up (:func:`benchmark`), as the planner's entry point (``k2.launcher.planning``) resolves its names:
#: most benchmarks import megatron-core and the model, which one benchmark's run should not wait for.
BENCHMARKS: dict[str, str] = {
    "attention": "attention",
    "optimizer": "optimizer",
    "pipeline": "pipeline",
    "ep_overlap": "ep_overlap",
    "memory": "activation_memory",
    "step": "step",
    "hf_convert": "hf_convert",
    "data": "data_prepare",
    "hardware": "hardware",
    "host_cost": "host_cost",
    "perf_model": "perf_model",
    "checkpoint": "checkpoint",
}


def benchmark(name: str) -> Callable[[K2Config], dict[str, Any]]:
    """The function of benchmark ``name`` (a key of :data:`BENCHMARKS`), its module imported now."""
    return getattr(importlib.import_module(f"{__package__}.{BENCHMARKS[name]}"), f"bench_{name}")


def run_bench(cfg: K2Config) -> dict[str, Any]:
    """The JSON record of ``cfg.bench.name`` (``none``: the list of benchmarks).

    Raises:
        ConfigError: unknown benchmark name or a bad option.
    """
    name = cfg.bench.name
    if name == "none":
        return {"bench": "none", "available": {k: describe(benchmark(k)) for k in BENCHMARKS}}
    if name not in BENCHMARKS:
        raise ConfigError(f"bench.name={name!r}; available: none, {', '.join(BENCHMARKS)}")
    with warnings.catch_warnings():  # importing megatron warns about the missing TE/Apex
        warnings.simplefilter("ignore")
        figures = benchmark(name)(cfg)
    options = cfg.bench.options
    from omegaconf import OmegaConf

    return {
        "bench": name,
        "system": system_info(),
        "options": OmegaConf.to_container(options) if options is not None else None,
        "figures": figures,
    }
