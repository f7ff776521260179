"""The plan of one config for one cluster, before any GPU: :func:`plan_cluster`, the planner's one entry
point (:mod:`k2.launcher.planning`): a layout, memory per GPU, pipeline bubble, step time and FLOPs.

For ``cluster.nodes x cluster.gpus_per_node`` GPUs (``cluster.gpu_memory_gib`` each, else the memory of
``plan.hardware``'s profile; ``cluster.peak_tflops`` dense BF16 peak) and any model / parallel / memory /
schedule config, without a GPU or a process group:

* **Layout** (:class:`k2.parallel.dims.ParallelDims`, megatron-core 0.19.2's placement): PP/VPP/EP/DP for
  the world size, which decoder layers each ``[pp_rank][vpp_stage]`` builds and which stage holds the
  embedding / the loss. K2's rule: the model-parallel group (TP x PP x EP GPUs; K2: PP16 x EP16 = 256
  GPUs = 32 nodes) is reused for any node count that is a multiple of it; another node count is refused.
  ``plan.search=true`` ranks every valid (pp, vpp, ep) (:mod:`k2.launcher.planning.search`).
* **Memory per GPU** (:mod:`k2.launcher.planning.memory`, :mod:`k2.launcher.planning.stage_activations`):
  parameters, FP32 gradient buffers and optimizer states as megatron lays them out, activations in flight in
  the simulated pipeline schedule with the ``memory.*`` switches; reported for the fullest GPU over the phases
  that run, and per phase (``phases``: the fullest GPU and the host memory of the fullest node of each phase
  that runs, against ``cluster.gpu_memory_gib`` and ``cluster.host_memory_gib``; ``fits`` only when every
  phase fits both).
* **Pipeline bubble** (:mod:`k2.launcher.planning.pipeline_sim`, :mod:`k2.launcher.planning.analysis`):
  megatron's (interleaved) 1F1B order simulated with per-stage costs from the layout's FLOPs;
  ``pipeline.decouple_wgrad=true`` plans the trainer's decoupled weight gradients.
* **FLOPs and MFU** (:mod:`k2.model.flops`, the formula ``k2-train`` logs MFU with).

:func:`plan_cluster` returns a :class:`ClusterPlan`; its ``report`` is the JSON record of ``output=json``
(keys: ``params_total``, ``params_active``, ``params``, ``world_size``, ``tp``/``pp``/``vpp``/``ep``/``dp``/
``expert_dp``, ``cluster``, ``model_parallel_group``, ``layout``, ``embedding_stage`` / ``loss_stage``,
``stages``, ``pp_ranks``, ``memory_per_gpu_bytes``, ``gpu_memory_bytes``, ``host_memory_bytes_per_node``,
``phases``, ``fits``, ``bubble_fraction``,
``pipeline``, ``flops_per_token``, ``flops``, ``global_batch_tokens``, ``num_microbatches``,
``step_time_s_estimated``, ``step_time_breakdown_s``, ``ep_overlap_requested`` / ``ep_overlap`` /
``ep_overlap_note`` (``pipeline.ep_overlap`` and whether the main phase runs it, or why not), ``ep_comm_s``
(its all-to-alls exposed and hidden), ``tokens_per_s_per_gpu_estimated``, ``hardware``, ``gemm_precision``,
``what_if``, ``step_time_s_flops_only``, ``mfu_estimated``, ``gpu_hours_estimated`` (every phase's steps
x its estimated step x GPUs), ``checkpoint``
(:func:`k2.launcher.planning.checkpoint.checkpoint_plan`), with ``plan.step_time_s`` also ``model_tflops_per_gpu``
and ``mfu``, with ``plan.search`` the ranked ``search`` list, the ``schedule``, and ``lr_at_tokens``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import ListConfig, OmegaConf

from k2.config import ConfigError
from k2.config.hardware import peak_tflops
from k2.launcher.planning.analysis import (
    _settings_key,
    analyse_layout,
    cluster_profile,
    flops_only_step_time,
    gpu_memory_assumed,
    gpu_memory_gib,
    host_memory_gib,
)
from k2.launcher.planning.checkpoint import checkpoint_plan
from k2.launcher.planning.pipeline_sim import PipelineResult
from k2.launcher.planning.search import WORLD_FROM
from k2.launcher.planning.verdict import search_verdict, with_global_batch, with_layout
from k2.model.flops import mfu
from k2.model.params import ModelParams, count_params
from k2.parallel.dims import ParallelDims
from k2.schedules.resolve import lr_at_tokens, resolve_schedule
from k2.schedules.wsd import Schedule

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = ["ClusterPlan", "check_model_parallel_group", "plan_cluster"]


@dataclass(frozen=True)
class ClusterPlan:
    """The plan of one config for one cluster.

    Attributes:
        report: the JSON-ready record (module docstring lists its keys); bytes, FLOPs, seconds.
        schedule: the resolved training schedule (``plot=`` draws it).
        pipeline: the simulated pipeline schedule of the main phase (``plot=`` draws its per-rank timeline).
    """

    report: dict[str, Any]
    schedule: Schedule
    pipeline: PipelineResult


def check_model_parallel_group(cfg: K2Config, world: int) -> None:
    """K2's rule (K2 report, "Training system"; ``docs/k2_reference.md``): one model-parallel group (PP x
    the larger of TP and EP's common multiple: EP spans the TP x DP ranks with expert TP 1; K2: PP16 x EP16 =
    256 GPUs = 32 nodes) is reused for any node count that is a multiple of it.

    Raises:
        ConfigError: ``world`` is not a multiple of the group, naming the allowed ``cluster.nodes``.
    """
    par, gpn = cfg.parallel, cfg.cluster.gpus_per_node
    tp, pp, ep = int(par.tp or 1), int(par.pp or 1), int(par.ep or 1)
    group = pp * math.lcm(tp, ep)
    if group < 1 or world % group == 0:
        return
    step = math.lcm(group, gpn) // gpn
    shape = (
        f"parallel.pp={pp} x parallel.ep={ep}"
        if tp == 1
        else f"parallel.pp={pp} x lcm(parallel.tp={tp}, parallel.ep={ep})"
    )
    raise ConfigError(
        f"cluster.nodes={cfg.cluster.nodes} x cluster.gpus_per_node={gpn} = {world} GPUs is not a multiple "
        f"of the model-parallel group {shape} = {group} GPUs "
        f"({group / gpn:g} nodes); the group is reused for any node count that is a multiple of {step} "
        f"(allowed cluster.nodes: {step}, {2 * step}, {3 * step}, ...)"
    )


def plan_cluster(cfg: K2Config) -> ClusterPlan:
    """Plan ``cfg`` (a validated config) on its ``cluster``.

    Raises:
        ConfigError: a layout that does not fit the world size, a schedule the layout cannot run, a model
            setting megatron cannot build, naming the setting.
    """
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    verdict = rows = counts = None
    if cfg.plan.search:  # the search first: the plan below is of the layout it recommends (verdict module)
        counts = _count_params(cfg)
        rows, verdict = search_verdict(cfg, world, counts)
        if verdict["global_batch_rounded"]:  # (the search's batch: the plan below is of it too)
            cfg = with_global_batch(cfg, verdict["global_batch_rounded"]["to"])
        if verdict["recommended"] is not None:
            cfg = with_layout(cfg, verdict["recommended"])  # (parallel.* only: the counts stand)
    check_model_parallel_group(cfg, world)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world, world_size_from=WORLD_FROM, tp_supported=True)
    schedule = resolve_schedule(cfg, dims)
    if counts is None:
        counts = _count_params(cfg)
    a = analyse_layout(cfg, dims, counts, schedule)
    report = {
        **_identity(cfg, dims, counts),
        "stages": _stages(dims, counts),
        "pp_ranks": _pp_ranks(dims, counts, a["worst"]["memory"]),
    }
    report["max_params_per_gpu"] = max(p["params_per_gpu"] for p in report["pp_ranks"])
    report.update(_memory(counts, schedule, a))
    report["cuda_alloc_conf"] = cfg.launch.cuda_alloc_conf  # what k2-train sets; the reserved bytes assume it
    report.update(_pipeline_and_flops(cfg, dims, schedule, a))
    if cfg.plan.step_time_s is not None:
        tflops, frac = mfu(
            report["flops"]["step_flops"], float(cfg.plan.step_time_s), dims.world_size, peak_tflops(cfg)
        )
        report.update(step_time_s=float(cfg.plan.step_time_s), model_tflops_per_gpu=tflops, mfu=frac)
    report["gpu_hours_estimated"] = (
        sum(r["steps"] * r["step_time_s_estimated"] for r in a["phases"]) * dims.world_size / 3600
    )
    report["checkpoint"] = checkpoint_plan(
        cfg, counts.total, dims.world_size, report["step_time_s_estimated"], cluster_profile(cfg).host_gbps
    )
    report["checkpoint"]["staged_host_bytes_per_node_pinned"] = (
        report["checkpoint"]["staged_host_bytes_per_node"] * a["staged_pinned_ratio"]
    )
    if verdict is not None:
        report["search"] = rows
        report["verdict"] = _verdict(verdict, report)
    return ClusterPlan(report, schedule, a["main"]["sim"])


def _count_params(cfg: K2Config) -> ModelParams:
    """:func:`k2.model.params.count_params` (it ignores ``parallel.*``), a bad model setting as a ConfigError."""
    try:
        return count_params(cfg)
    except ValueError as e:  # e.g. model.first_k_dense_replace out of range
        raise ConfigError(str(e)) from None


def _verdict(verdict: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """The search's verdict (:func:`k2.launcher.planning.verdict.search_verdict`) with the recommended layout's
    step, MFU and the two largest terms of its step (``dominant``: ``[term, seconds]``)."""
    terms = sorted(report["step_time_breakdown_s"].items(), key=lambda kv: -kv[1])
    return {
        **verdict,
        "step_time_s_estimated": report["step_time_s_estimated"],
        "mfu_estimated": report["mfu_estimated"],
        "dominant": [list(t) for t in terms[:2]],
        "memory_per_gpu_bytes": report["memory_per_gpu_bytes"]["total"],
        "gpu_memory_bytes": report["gpu_memory_bytes"],
        # the limits that fail, each phase's worst: GPU memory, host memory per node
        "fits_gpu": all(p["fits_gpu"] for p in report["phases"]),
        "fits_host": all(p["fits_host"] for p in report["phases"]),
        "host_bytes_per_node": max(p["host_bytes_per_node"] for p in report["phases"]),
        "host_memory_bytes_per_node": report["host_memory_bytes_per_node"],
    }


def _identity(cfg: K2Config, dims: ParallelDims, counts: ModelParams) -> dict[str, Any]:
    """Model, cluster, parallel sizes and the layer table."""
    gpn = cfg.cluster.gpus_per_node
    group = dims.pp * math.lcm(dims.tp, dims.ep)
    return {
        "model": cfg.model.name,
        "parallel": cfg.parallel.name,
        "world_size": dims.world_size,
        "nodes": cfg.cluster.nodes,
        "gpus_per_node": gpn,
        "cluster": {
            "nodes": cfg.cluster.nodes,
            "gpus_per_node": gpn,
            "gpu_memory_gib": gpu_memory_gib(cfg),
            "gpu_memory_assumed": gpu_memory_assumed(cfg),
            "host_memory_gib": host_memory_gib(cfg),
            "peak_tflops": peak_tflops(cfg),
        },
        "model_parallel_group": {
            "gpus": group,
            "nodes": group / gpn,
            "replicas": dims.world_size // group,
            "shape": f"TP{dims.tp} x PP{dims.pp} x EP{dims.ep}",
            # k2-train runs TP 1 only; k2-plan plans megatron's TP layout
            "k2_train_runs": dims.tp == 1,
        },
        "tp": dims.tp,
        "pp": dims.pp,
        "vpp": dims.vpp,
        "ep": dims.ep,
        "dp": dims.dp,
        "expert_dp": dims.expert_dp,
        "num_layers": dims.num_layers,
        "params_total": counts.total,
        "params_active": counts.active,
        "params": counts.as_dict(),
        "megatron_layout": dims.megatron_layout,
        "layout": dims.stage_layers,
        "embedding_stage": {"pp_rank": 0, "vpp_stage": 0},
        "loss_stage": {"pp_rank": dims.pp - 1, "vpp_stage": dims.vpp - 1},
    }


def _stages(dims: ParallelDims, counts: ModelParams) -> list[dict[str, Any]]:
    """One row per virtual stage, in pipeline order: its layers and parameters."""
    stages = []
    for v in range(dims.vpp):
        for r in range(dims.pp):
            layers = dims.layers(r, v)
            emb, loss = dims.stage_has_embedding(r, v), dims.stage_has_loss(r, v)
            stages.append(
                {
                    "virtual_stage": dims.virtual_stage(r, v),
                    "pp_rank": r,
                    "vpp_stage": v,
                    "layers": layers,
                    "num_moe_layers": sum(counts.moe_pattern[i] for i in layers),
                    "has_embedding": emb,
                    "has_loss": loss,
                    "params": counts.stage(layers, emb, loss),
                }
            )
    return stages


def _pp_ranks(dims: ParallelDims, counts: ModelParams, memory: list) -> list[dict[str, Any]]:
    """One row per PP rank (all its virtual stages): parameters per GPU and the memory of its fullest GPU."""
    rows = []
    for r in range(dims.pp):
        layers, emb, loss = dims.pp_rank_contents(r)
        per_gpu = counts.stage(layers, emb, loss, ep=dims.ep, tp=dims.tp)
        rows.append(
            {
                "pp_rank": r,
                "layers": layers,
                "num_layers": len(layers),
                "has_embedding": emb,
                "has_loss": loss,
                "params": counts.stage(layers, emb, loss),
                "params_per_gpu": per_gpu,
                "bf16_param_bytes_per_gpu": 2 * per_gpu,
                "fp32_grad_bytes_per_gpu": 4 * per_gpu,
                "memory_bytes": memory[r].as_dict(),
            }
        )
    return rows


def _memory(counts: ModelParams, schedule: Schedule, a: dict) -> dict[str, Any]:
    """Bytes: totals over the cluster, the fullest GPU over the phases that run, the fit."""
    mem, worst_phase = a["worst_gpu"], a["worst"]["phases"][0]
    all_states = [x for row in a["states"] for x in row]
    return {
        "bf16_param_bytes_total": 2 * counts.total,
        "param_and_grad_bytes_total": 6 * counts.total,
        "memory_per_gpu_bytes": {
            "params": mem.params,
            "grads": mem.grads,
            "optimizer": mem.optimizer,
            "activations": mem.activations,
            "transient": mem.transient,
            "reserved": mem.reserved,
            "allocated": mem.allocated,
            "total": mem.total,
            "host_pinned": mem.host_pinned,
            "optimizer_offloaded_to_host": mem.optimizer_offloaded,
            "activations_offloaded_to_host_peak": mem.activations_offloaded_peak,
            "microbatches_in_flight": mem.in_flight,
            "pp_rank": mem.pp_rank,
            "phase": worst_phase,
            "seq_length": next(p.seq_length for p in schedule.phases if p.name == worst_phase),
        },
        "allocated_param_and_grad_bytes_mean_per_gpu": sum(x.params + x.grads for x in all_states) / len(all_states),
        "gpu_memory_bytes": a["capacity_bytes"],
        "host_memory_bytes_per_node": a["host_capacity_bytes"],
        "phases": a["phases"],
        "fits": a["fits"],
    }


def _pipeline_and_flops(cfg: K2Config, dims: ParallelDims, schedule: Schedule, a: dict) -> dict[str, Any]:
    """The main phase's simulated pipeline, FLOPs, estimated step time and MFU; the schedule."""
    main, main_res = a["main_phase"], a["main"]
    fl, sim = main_res["flops"], main_res["sim"]
    tokens_per_step = schedule.global_batch_tokens
    step_flops = fl.training * tokens_per_step
    est = main_res["makespan"]
    st = main_res["step_time"]
    flops_only = flops_only_step_time(cfg, dims, main, tuple(_settings_key(main_res["memory_settings"])[1]))
    query = cfg.plan.query_tokens
    if query is not None:
        query = OmegaConf.to_container(query) if isinstance(query, ListConfig) else [query]
    profile = cluster_profile(cfg)
    return {
        "bubble_fraction": main_res["bubble"],
        "pipeline": {
            **sim.as_dict(),
            "phase": main.name,
            "decouple_wgrad": bool(cfg.pipeline.decouple_wgrad),
            "peak_activation_bytes_per_rank": sim.peak_activation_bytes,
        },
        "flops_per_token": fl.training,
        "flops": {**fl.as_dict(), "phase": main.name, "step_flops": step_flops},
        "global_batch_tokens": tokens_per_step,
        "num_microbatches": main.num_microbatches,
        "micro_batch_size": main.micro_batch_size,
        "seq_length": main.seq_length,
        "step_time_s_estimated": est,
        "step_time_breakdown_s": dict(st.breakdown),
        "ep_overlap_requested": bool(cfg.pipeline.ep_overlap),
        "ep_overlap": main_res["ep_overlap"],
        "ep_overlap_note": main_res["ep_overlap_note"],
        "ep_comm_s": st.ep_comm,
        "tokens_per_s_per_gpu_estimated": tokens_per_step / est / dims.world_size,
        "hardware": profile.name,
        # GPUs of the job per NVLink domain (the node, or its part of an NVL72 rack: cluster.segment_nodes)
        "nvlink_domain_gpus": profile.domain_gpus,
        # the layers' GEMMs: train.fp8_recipe's FP8 scaling, else train.precision
        "gemm_precision": str(cfg.train.fp8_recipe or cfg.train.precision),
        "what_if": st.what_if,
        "mfu_estimated": mfu(step_flops, est, dims.world_size, peak_tflops(cfg))[1],
        "step_time_s_flops_only": flops_only,
        "compute_efficiency": float(cfg.plan.compute_efficiency),
        "schedule": schedule.as_dict(),
        **({"lr_at_tokens": lr_at_tokens(schedule, query)} if query is not None else {}),
    }
