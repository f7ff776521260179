"""Bubble, estimated step time, memory per GPU and fit of one layout (``k2-plan`` and its search): the
main phase simulated with megatron's order, per-stage F / B / W costs from the layout's model FLOPs.
"""

from __future__ import annotations

from typing import Any

from k2.launcher.planning.memory import gpu_memory, stage_activations, state_bytes, state_bytes_lower_bound
from k2.model.flops import flops_per_token
from k2.schedules.pipeline_sim import simulate


def main_phase(schedule):
    """The phase that runs the most steps (bubble, FLOPs and step time are reported for it)."""
    running = [p for p in schedule.phases if p.steps]
    return max(running, key=lambda p: (p.steps, -p.index))


def memory_cfg(cfg):
    """The ``memory`` section of ``cfg``, or None for a config without one."""
    return cfg.get("memory") if hasattr(cfg, "get") else getattr(cfg, "memory", None)


def stage_costs(fl, dims, tokens: int, tflops: float, recompute=()) -> tuple[list, list, list]:
    """Per virtual stage (pipeline order) the seconds of one microbatch's forward (F), input gradient (B)
    and weight gradient (W), from the model FLOPs of the stage's layers (:mod:`k2.model.flops`; the LM head
    on the loss stage, the embedding lookup costs 0) at ``tflops`` TFLOP/s.

    B = the weight GEMMs' forward FLOPs + twice core attention's (it has no weights) + the FLOPs of
    recomputed GEMMs (``memory.recompute``: ``mla_up_proj`` redoes the q/kv up-projections,
    ``moe_down_proj`` the routed experts' down-projection); W = the weight GEMMs' forward FLOPs.
    """
    rate = tflops * 1e12
    F, B, W = [], [], []
    up = fl.attention_up_proj if "mla_up_proj" in recompute else 0
    down = fl.routed_experts / 3 if "moe_down_proj" in recompute else 0  # fc2 = 1/3 of the SwiGLU GEMMs
    for v in range(dims.vpp):
        for r in range(dims.pp):
            f = b = w = 0.0
            for i in dims.layout[r][v]:
                gemm = fl.layer_gemm(i)
                f += fl.layer(i)
                b += gemm + 2 * fl.attention_core + up + (down if fl.moe_pattern[i] else 0)
                w += gemm
            if dims.stage_has_loss(r, v):
                f, b, w = f + fl.lm_head, b + fl.lm_head, w + fl.lm_head
            F.append(f * tokens / rate)
            B.append(b * tokens / rate)
            W.append(w * tokens / rate)
    return F, B, W


def analyse_layout(cfg, dims, counts, schedule, *, max_microbatches: int | None = None,
                   cache: dict | None = None, prune: bool = False) -> dict[str, Any]:
    """Bubble, estimated step time, memory per GPU and fit of one layout (``k2-plan`` and its search).

    The schedule of the main phase (:func:`main_phase`) is simulated with megatron's order
    (:func:`k2.schedules.pipeline_sim.simulate`, stage costs from :func:`stage_costs` at
    ``cluster.peak_tflops x plan.compute_efficiency``). Memory (:mod:`k2.launcher.planning.memory`) is the fullest
    GPU over the phases that run (activations grow with the context: K2's 32K anneal).

    With ``max_microbatches`` (the search), at most that many microbatches are simulated (a multiple of
    pp) and the rest of the step is extrapolated at the busiest rank's per-microbatch time; exact for
    equal stages, and the peak in flight is reached by then (the warm-up is < 2 pp + (vpp-1) pp
    forwards). ``cache`` is handed to :func:`k2.launcher.planning.memory.state_bytes`. With ``prune``, a layout
    whose parameters and gradients alone exceed the GPU memory gets the cheap lower bound
    (:func:`k2.launcher.planning.memory.state_bytes_lower_bound`; ``"memory_lower_bound": True``) instead of its
    megatron buffer layouts.
    """

    mem_cfg = memory_cfg(cfg)
    recompute = list(mem_cfg.recompute or []) if mem_cfg is not None else []
    tflops = float(cfg.cluster.peak_tflops) * float(cfg.plan.compute_efficiency)
    split = bool(cfg.pipeline.decouple_wgrad)
    capacity = float(cfg.cluster.gpu_memory_gib) * 2**30
    states = state_bytes_lower_bound(counts, dims, precision=cfg.train.precision) if prune else None
    lower_bound = bool(states) and max(x.params + x.grads for row in states for x in row) > capacity
    if not lower_bound:
        states = state_bytes(counts, dims, precision=cfg.train.precision, optimizer=cfg.optim.name,
                             use_distributed_optimizer=bool(cfg.parallel.use_distributed_optimizer),
                             model_cfg=cfg.model, cache=cache, router_optimizer=cfg.optim.router_optimizer,
                             muon_zero1=cfg.optim.muon_zero1)
    main = main_phase(schedule)
    results: dict[Any, dict] = {}
    for phase in [p for p in schedule.phases if p.steps]:
        key = (phase.seq_length, phase.micro_batch_size, phase.num_microbatches)
        if key in results:
            results[key]["phases"].append(phase.name)
            continue
        fl = flops_per_token(cfg.model, phase.seq_length)
        tokens = phase.seq_length * phase.micro_batch_size
        F, B, W = stage_costs(fl, dims, tokens, tflops, recompute)
        m = phase.num_microbatches
        m_sim = m
        if max_microbatches is not None and m > max_microbatches:
            m_sim = max(dims.pp, max_microbatches // dims.pp * dims.pp)
        acts = stage_activations(cfg.model, dims, seq_length=phase.seq_length,
                                 micro_batch_size=phase.micro_batch_size, precision=cfg.train.precision,
                                 memory_cfg=mem_cfg, fused_kernels=True)
        sim = simulate(dims.pp, dims.vpp, m_sim, F, B, W, decouple_wgrad=split,
                       activation_bytes=[a.gpu for a in acts])
        period = [sum(F[v * dims.pp + r] + B[v * dims.pp + r] + W[v * dims.pp + r] for v in range(dims.vpp))
                  for r in range(dims.pp)]
        makespan = sim.makespan + (m - m_sim) * max(period)
        busy = [x * m for x in period]
        mem = gpu_memory(states, acts, sim, dims, float(cfg.optim.offload_fraction))
        results[key] = {"phases": [phase.name], "sim": sim, "makespan": makespan,
                        "bubble": (dims.pp * makespan - sum(busy)) / sum(busy), "memory": mem,
                        "flops": fl, "tokens_per_microbatch": tokens, "num_microbatches": m}
    main_res = results[(main.seq_length, main.micro_batch_size, main.num_microbatches)]
    worst_key = max(results, key=lambda k: max(g.total for g in results[k]["memory"]))
    worst = results[worst_key]
    worst_gpu = max(worst["memory"], key=lambda g: g.total)
    return {"main_phase": main, "main": main_res, "worst": worst, "worst_gpu": worst_gpu,
            "fits": worst_gpu.total <= capacity and not lower_bound, "capacity_bytes": capacity,
            "results": results, "states": states, "memory_lower_bound": lower_bound}
