"""``k2-plan``: choose and check a layout for a cluster before spending GPU hours, on a laptop, in seconds.

Example::

    k2-plan model=kimi_k2 parallel=k2_256gpu memory=k2 train.precision=bf16 train.micro_batch_size=1 \
        plan.optimizer_offload_fraction=1 plot=k2.png            # + output=json, plan.search=true

For ``cluster.nodes x cluster.gpus_per_node`` GPUs (``cluster.gpu_memory_gib`` each, ``cluster.peak_tflops``
dense BF16 peak) and any model / parallel / memory / schedule config, without a GPU or a process group:

* **Layout** (:class:`parallel.dims.ParallelDims`, megatron-core 0.19.2's placement, checked against
  megatron in ``tests/test_dims.py``): PP/VPP/EP/DP for the world size, which decoder layers each
  ``[pp_rank][vpp_stage]`` builds and which stage holds the embedding / the loss. K2's rule: the
  model-parallel group (TP x PP x EP GPUs; K2: PP16 x EP16 = 256 GPUs = 32 nodes) is reused for any
  node count that is a multiple of it; another node count is refused, saying so. ``plan.search=true``
  lists every valid (pp, vpp, ep) of the cluster with a cost-balanced layout
  (:func:`parallel.dims.balanced_layout`), the ones that fit in memory first, each group ranked by
  estimated step time.
* **Memory per GPU** (:mod:`parallel.memory`, :mod:`model.activations`): parameters, FP32 gradient
  buffers and optimizer states (AdamW / Muon, ZeRO-1 over DP, ``plan.optimizer_offload_fraction`` in
  host memory) as megatron lays them out -- equal to what ``k2-train`` allocates; activations per
  microbatch (MLA latents, top-k expert copies, ``memory.*`` FP8 storage / recompute / offload) times what
  the simulated schedule holds in flight. Reported for the fullest GPU over the phases that run (K2's
  32K-context anneal holds 8x the activations of the 4K phases).
* **Pipeline bubble** (:mod:`schedules.pipeline_sim`): megatron's (interleaved) 1F1B order simulated
  with per-stage costs from the layout's FLOPs (embedding and LM head included;
  ``plan.split_backward=true`` decouples weight gradients); bubble fraction = idle / busy over the PP
  ranks, ``(p-1)/(v m)`` for equal stages. Estimated step time at ``plan.compute_efficiency`` of peak
  (communication is not modelled). ``plot=PATH.png`` draws the per-rank timeline (and the LR schedule
  into ``PATH_schedule.png``).
* **FLOPs and MFU** (:mod:`model.flops`, the formula ``k2-train`` logs MFU with): model FLOPs per token
  per term, tokens per step, and with ``plan.step_time_s`` (a measured step time) the MFU against
  ``cluster.peak_tflops``. Bubble, FLOPs and step time are for the main phase (the one with the most
  steps).

Output (``output=json``: one JSON object on stdout; ``output=table`` or ``text``, the default: tables):
``params_total``, ``params_active``, ``params`` (per component), ``world_size``, ``tp``/``pp``/``vpp``/``ep``/
``dp``/``expert_dp``, ``cluster``, ``model_parallel_group``, ``layout[pp_rank][vpp_stage]`` (global 0-based
layers), ``embedding_stage`` / ``loss_stage``, ``stages`` and ``pp_ranks`` (layers, parameters, and per PP
rank ``memory_bytes``), ``memory_per_gpu_bytes`` (``params``, ``grads``, ``optimizer``, ``activations``,
``total``, host-offloaded parts, microbatches in flight, its PP rank and phase), ``gpu_memory_bytes``,
``fits``, ``bubble_fraction``, ``pipeline`` (the simulation), ``flops_per_token`` (training),
``flops`` (forward terms), ``global_batch_tokens``, ``num_microbatches``, ``step_time_s_estimated``,
``mfu_estimated``, with ``plan.step_time_s`` also ``model_tflops_per_gpu`` and ``mfu``, with
``plan.search`` the ranked ``search`` list, the training ``schedule``, and ``lr_at_tokens`` (with
``plan.query_tokens=[t1,...]``).

Errors: an invalid setting (``ConfigError``: unknown key, a node count that is not a multiple of the
model-parallel group, experts not divisible by ``parallel.ep``, a bad ``parallel.layout``, a non-positive
``cluster.peak_tflops``, ...) prints one line ``k2-plan: error: ...`` to stderr and exits with status 2.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from launcher.config import ConfigError, load_config

_WORLD_FROM = "cluster.nodes x cluster.gpus_per_node"
_OUTPUTS = ("text", "table", "json")
_SEARCH_VPP = (1, 2, 3, 4)  # virtual stages per PP rank tried by plan.search
_SEARCH_MICROBATCHES = 4  # plan.search simulates min(m, 4 pp) microbatches and extrapolates (docstring)


def _world_size(cfg) -> int:
    nodes, gpn = cfg.cluster.nodes, cfg.cluster.gpus_per_node
    for key, value in (("cluster.nodes", nodes), ("cluster.gpus_per_node", gpn)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be an integer >= 1")
    return nodes * gpn


def _check_numbers(cfg) -> None:
    """The cluster's and ``plan.*``'s numbers (one ConfigError naming the setting)."""
    c, p = cfg.cluster, cfg.plan
    checks = [
        ("cluster.gpu_memory_gib", c.gpu_memory_gib, c.gpu_memory_gib > 0, "a number > 0 (GiB)"),
        ("cluster.peak_tflops", c.peak_tflops, c.peak_tflops > 0, "a number > 0 (dense BF16 TFLOP/s per GPU)"),
        ("plan.compute_efficiency", p.compute_efficiency, 0 < p.compute_efficiency <= 1, "0 < value <= 1"),
        ("plan.optimizer_offload_fraction", p.optimizer_offload_fraction,
         0 <= p.optimizer_offload_fraction <= 1, "0 <= value <= 1"),
    ]
    if p.step_time_s is not None:
        checks.append(("plan.step_time_s", p.step_time_s, p.step_time_s > 0, "seconds > 0, or null"))
    for key, value, ok, allowed in checks:
        if not (ok and math.isfinite(value)):
            raise ConfigError(f"{key}={value}; allowed: {allowed}")


def _check_model_parallel_group(cfg, world: int) -> None:
    """K2's rule (REFERENCE.md "Training system"): one model-parallel group (TP x PP x EP GPUs; K2: PP16 x
    EP16 = 256 GPUs = 32 nodes) is reused for any node count that is a multiple of it."""
    par, gpn = cfg.parallel, cfg.cluster.gpus_per_node
    group = int(par.tp or 1) * int(par.pp or 1) * int(par.ep or 1)
    if group < 1 or world % group == 0:
        return
    step = math.lcm(group, gpn) // gpn
    raise ConfigError(
        f"cluster.nodes={cfg.cluster.nodes} x cluster.gpus_per_node={gpn} = {world} GPUs is not a multiple "
        f"of the model-parallel group parallel.pp={par.pp} x parallel.ep={par.ep} = {group} GPUs "
        f"({group / gpn:g} nodes); the group is reused for any node count that is a multiple of {step} "
        f"(allowed cluster.nodes: {step}, {2 * step}, {3 * step}, ...)"
    )


def _query_tokens(cfg) -> list | None:
    from omegaconf import ListConfig, OmegaConf

    q = cfg.plan.query_tokens
    if q is None:
        return None
    return OmegaConf.to_container(q) if isinstance(q, ListConfig) else [q]


def _main_phase(schedule):
    """The phase that runs the most steps (bubble, FLOPs and step time are reported for it)."""
    running = [p for p in schedule.phases if p.steps]
    return max(running, key=lambda p: (p.steps, -p.index))


def _memory_cfg(cfg):
    return cfg.get("memory") if hasattr(cfg, "get") else getattr(cfg, "memory", None)


def stage_costs(fl, dims, tokens: int, tflops: float, recompute=()) -> tuple[list, list, list]:
    """Per virtual stage (pipeline order) the seconds of one microbatch's forward (F), input gradient (B)
    and weight gradient (W), from the model FLOPs of the stage's layers (:mod:`model.flops`; the LM head
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

    The schedule of the main phase (:func:`_main_phase`) is simulated with megatron's order
    (:func:`schedules.pipeline_sim.simulate`, stage costs from :func:`stage_costs` at
    ``cluster.peak_tflops x plan.compute_efficiency``). Memory (:mod:`parallel.memory`) is the fullest
    GPU over the phases that run (activations grow with the context: K2's 32K anneal).

    With ``max_microbatches`` (the search), at most that many microbatches are simulated (a multiple of
    pp) and the rest of the step is extrapolated at the busiest rank's per-microbatch time; exact for
    equal stages, and the peak in flight is reached by then (the warm-up is < 2 pp + (vpp-1) pp
    forwards). ``cache`` is handed to :func:`parallel.memory.state_bytes`. With ``prune``, a layout
    whose parameters and gradients alone exceed the GPU memory gets the cheap lower bound
    (:func:`parallel.memory.state_bytes_lower_bound`; ``"memory_lower_bound": True``) instead of its
    megatron buffer layouts.
    """
    from model.flops import flops_per_token
    from parallel.memory import gpu_memory, stage_activations, state_bytes, state_bytes_lower_bound
    from schedules.pipeline_sim import simulate

    mem_cfg = _memory_cfg(cfg)
    recompute = list(mem_cfg.recompute or []) if mem_cfg is not None else []
    tflops = float(cfg.cluster.peak_tflops) * float(cfg.plan.compute_efficiency)
    split = bool(cfg.plan.split_backward)
    capacity = float(cfg.cluster.gpu_memory_gib) * 2**30
    states = state_bytes_lower_bound(counts, dims, precision=cfg.train.precision) if prune else None
    lower_bound = bool(states) and max(x.params + x.grads for row in states for x in row) > capacity
    if not lower_bound:
        states = state_bytes(counts, dims, precision=cfg.train.precision, optimizer=cfg.optim.name,
                             use_distributed_optimizer=bool(cfg.parallel.use_distributed_optimizer),
                             model_cfg=cfg.model, cache=cache)
    main = _main_phase(schedule)
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
        sim = simulate(dims.pp, dims.vpp, m_sim, F, B, W, split_backward=split,
                       activation_bytes=[a.gpu for a in acts])
        period = [sum(F[v * dims.pp + r] + B[v * dims.pp + r] + W[v * dims.pp + r] for v in range(dims.vpp))
                  for r in range(dims.pp)]
        makespan = sim.makespan + (m - m_sim) * max(period)
        busy = [x * m for x in period]
        mem = gpu_memory(states, acts, sim, dims, float(cfg.plan.optimizer_offload_fraction))
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


def _search(cfg, world: int, counts) -> list[dict[str, Any]]:
    """``plan.search=true``: every valid (pp, vpp, ep) for the world size, with a cost-balanced layout
    (:func:`parallel.dims.balanced_layout`): the layouts that fit in memory first, each group ranked by
    estimated step time (``fits`` marks them). EP changes memory only here: the all-to-all is not
    modelled."""
    from omegaconf import OmegaConf

    from model.flops import flops_per_token
    from parallel.dims import ParallelDims, balanced_layout
    from schedules.wsd import resolve_schedule

    L = int(cfg.model.num_layers)
    experts = int(cfg.model.num_moe_experts or 0)
    rows, cache = [], {}
    base = OmegaConf.to_container(cfg, resolve=True)
    fl = flops_per_token(cfg.model, resolve_schedule(cfg).phases[0].seq_length)
    layer_costs = [fl.layer(i) for i in range(L)]
    for pp in [d for d in range(1, world + 1) if world % d == 0]:
        for vpp in _SEARCH_VPP:
            if (vpp > 1 and pp < 2) or pp * vpp > L + 1:
                continue
            layout = balanced_layout(layer_costs, pp, vpp, 0.0, fl.lm_head)
            dp = world // pp
            for ep in [d for d in range(1, dp + 1) if dp % d == 0 and (experts % d == 0 if experts else d == 1)]:
                par = dict(base["parallel"], pp=pp, vpp=vpp if vpp > 1 else None, ep=ep, layout=layout,
                           first_stage_layers=None, last_stage_layers=None)
                c = OmegaConf.merge(cfg, {"parallel": par})
                try:
                    dims = ParallelDims.from_config(c.parallel, c.model, world, world_size_from=_WORLD_FROM)
                    schedule = resolve_schedule(c, dims)
                except ConfigError:  # e.g. the batch does not split into whole microbatches
                    continue
                a = analyse_layout(c, dims, counts, schedule,
                                   max_microbatches=_SEARCH_MICROBATCHES * pp, cache=cache, prune=True)
                rows.append({
                    "pp": pp, "vpp": vpp, "ep": ep, "dp": dims.dp, "layout": layout,
                    "num_microbatches": a["main"]["num_microbatches"],
                    "bubble_fraction": a["main"]["bubble"],
                    "step_time_s_estimated": a["main"]["makespan"],
                    "memory_per_gpu_bytes": a["worst_gpu"].total,
                    "memory_lower_bound": a["memory_lower_bound"],
                    "fits": a["fits"],
                })
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s_estimated"], r["memory_per_gpu_bytes"]))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return rows


def make_plan(cfg) -> dict[str, Any]:
    """The plan of ``cfg`` as a JSON-ready dict (keys listed in the module docstring).

    Raises:
        ConfigError: invalid cluster / parallel / model / schedule / plan settings, naming the setting.
    """
    from model.flops import mfu
    from parallel.dims import ParallelDims
    from schedules.wsd import lr_at_tokens, resolve_schedule

    world = _world_size(cfg)
    _check_numbers(cfg)
    if cfg.output not in _OUTPUTS:
        raise ConfigError(f"output={cfg.output!r}; allowed: {', '.join(_OUTPUTS)}")
    if _memory_cfg(cfg) is not None:
        from model.memory import check_memory_config

        check_memory_config(cfg)  # the trainer's own check: same sites, same message
    _check_model_parallel_group(cfg, world)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world, world_size_from=_WORLD_FROM)
    schedule = resolve_schedule(cfg, dims)
    query = _query_tokens(cfg)
    from model.params import count_params

    try:
        counts = count_params(cfg)
    except ValueError as e:  # e.g. model.first_k_dense_replace out of range
        raise ConfigError(str(e)) from None

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
    a = analyse_layout(cfg, dims, counts, schedule)
    main, main_res, worst = a["main_phase"], a["main"], a["worst"]
    pp_ranks = []
    for r in range(dims.pp):
        layers = [i for v in range(dims.vpp) for i in dims.layout[r][v]]
        emb = any(dims.stage_has_embedding(r, v) for v in range(dims.vpp))
        loss = any(dims.stage_has_loss(r, v) for v in range(dims.vpp))
        per_gpu = counts.stage(layers, emb, loss, ep=dims.ep)
        pp_ranks.append(
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
                "memory_bytes": worst["memory"][r].as_dict(),
            }
        )
    last_v = dims.vpp - 1
    fl = main_res["flops"]
    tokens_per_step = schedule.global_batch_tokens
    step_flops = fl.training * tokens_per_step
    est = main_res["makespan"]
    group = dims.tp * dims.pp * dims.ep
    gpn = cfg.cluster.gpus_per_node
    mem = a["worst_gpu"]
    all_states = [x for row in a["states"] for x in row]
    out = {
        "model": cfg.model.name,
        "parallel": cfg.parallel.name,
        "world_size": dims.world_size,
        "nodes": cfg.cluster.nodes,
        "gpus_per_node": gpn,
        "cluster": {"nodes": cfg.cluster.nodes, "gpus_per_node": gpn,
                    "gpu_memory_gib": float(cfg.cluster.gpu_memory_gib),
                    "peak_tflops": float(cfg.cluster.peak_tflops)},
        "model_parallel_group": {"gpus": group, "nodes": group / gpn, "replicas": dims.world_size // group,
                                 "shape": f"TP{dims.tp} x PP{dims.pp} x EP{dims.ep}"},
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
        "layout": dims.layout,
        "embedding_stage": {"pp_rank": 0, "vpp_stage": 0},
        "loss_stage": {"pp_rank": dims.pp - 1, "vpp_stage": last_v},
        "stages": stages,
        "pp_ranks": pp_ranks,
        "max_params_per_gpu": max(p["params_per_gpu"] for p in pp_ranks),
        "bf16_param_bytes_total": 2 * counts.total,
        "param_and_grad_bytes_total": 6 * counts.total,
        # --- memory of the fullest GPU (all phases that run)
        "memory_per_gpu_bytes": {
            "params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer,
            "activations": mem.activations, "total": mem.total,
            "optimizer_offloaded_to_host": mem.optimizer_offloaded,
            "activations_offloaded_to_host_peak": mem.activations_offloaded_peak,
            "microbatches_in_flight": mem.in_flight, "pp_rank": mem.pp_rank,
            "phase": worst["phases"][0],
        },
        "allocated_param_and_grad_bytes_mean_per_gpu": sum(x.params + x.grads for x in all_states)
        / len(all_states),
        "gpu_memory_bytes": a["capacity_bytes"],
        "fits": a["fits"],
        # --- pipeline of the main phase
        "bubble_fraction": main_res["bubble"],
        "pipeline": {**main_res["sim"].as_dict(), "phase": main.name, "split_backward": bool(cfg.plan.split_backward),
                     "peak_activation_bytes_per_rank": main_res["sim"].peak_activation_bytes},
        # --- FLOPs
        "flops_per_token": fl.training,
        "flops": {**fl.as_dict(), "phase": main.name, "step_flops": step_flops},
        "global_batch_tokens": tokens_per_step,
        "num_microbatches": main.num_microbatches,
        "micro_batch_size": main.micro_batch_size,
        "seq_length": main.seq_length,
        "step_time_s_estimated": est,
        "mfu_estimated": mfu(step_flops, est, dims.world_size, float(cfg.cluster.peak_tflops))[1],
        "compute_efficiency": float(cfg.plan.compute_efficiency),
        "schedule": schedule.as_dict(),
        **({"lr_at_tokens": lr_at_tokens(schedule, query)} if query is not None else {}),
        "_schedule": schedule,  # for plot=; dropped from the JSON
        "_sim": main_res["sim"],
    }
    out["memory_per_gpu_bytes"]["seq_length"] = next(
        p.seq_length for p in schedule.phases if p.name == worst["phases"][0])
    if cfg.plan.step_time_s is not None:
        tflops, frac = mfu(step_flops, float(cfg.plan.step_time_s), dims.world_size, float(cfg.cluster.peak_tflops))
        out.update(step_time_s=float(cfg.plan.step_time_s), model_tflops_per_gpu=tflops, mfu=frac)
    if cfg.plan.search:
        out["search"] = _search(cfg, world, counts)
    return out


# ---------------------------------------------------------------------- text output


def _human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def _gib(nbytes: float) -> str:
    g = nbytes / 2**30
    return f"{g:.1f}" if g >= 10 or g == 0 else f"{g:.3g}"


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], None
    for k, i in enumerate(ids):
        if start is None:
            start = i
        if k + 1 == len(ids) or ids[k + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ",".join(out)


def format_text(plan: dict[str, Any]) -> str:
    """Readable tables of :func:`make_plan`'s dict."""
    p = plan["params"]
    lines = [
        f"k2-plan: model={plan['model']} parallel={plan['parallel']} on {plan['nodes']} "
        f"node{'s' if plan['nodes'] != 1 else ''} x "
        f"{plan['gpus_per_node']} GPUs = {plan['world_size']} ranks",
        f"  tp {plan['tp']} x pp {plan['pp']} x dp {plan['dp']} (ep {plan['ep']} x expert-dp "
        f"{plan['expert_dp']}); vpp {plan['vpp']}; {plan['num_layers']} layers ({p['num_dense_layers']} "
        f"dense, {p['num_moe_layers']} MoE); layout {plan['megatron_layout'] or '(megatron default)'}",
        "",
        f"  params_total  {plan['params_total']:>20,}  ({_human(plan['params_total'])})",
        f"  params_active {plan['params_active']:>20,}  ({_human(plan['params_active'])} per token)",
        "",
        f"  {'component':<34}{'params each':>18}{'x count':>9}{'total':>20}",
    ]
    nd, nm = p["num_dense_layers"], p["num_moe_layers"]
    rows = [
        ("embedding", p["embedding"], 1),
        ("attention + input norm (per layer)", p["attention_per_layer"], plan["num_layers"]),
        ("pre-MLP norm (per layer)", p["mlp_norm_per_layer"], plan["num_layers"]),
        ("dense MLP (per dense layer)", p["dense_mlp_per_layer"], nd),
        ("router (per MoE layer)", p["router_per_moe_layer"], nm),
        (f"routed expert (x{p['num_experts']} per MoE layer)", p["routed_expert_each"],
         nm * p["num_experts"]),
        ("shared expert(s) (per MoE layer)", p["shared_experts_per_moe_layer"], nm),
        ("final norm", p["final_norm"], 1),
        ("output head", p["output_head"], 1),
    ]
    for name, each, count in rows:
        if count and (each or name in ("output head",)):
            lines.append(f"  {name:<34}{each:>18,}{count:>9,}{each * count:>20,}")
    lines += [
        "",
        f"  {'pp rank':<8}"
        + "".join(f"{'vpp ' + str(v):<14}" for v in range(plan["vpp"]))
        + f"{'params (stage)':>18}{'params/GPU':>16}{'bf16 GiB/GPU':>14}{'fp32 grad GiB':>16}",
    ]
    for r, rank in enumerate(plan["pp_ranks"]):
        cells = []
        for v in range(plan["vpp"]):
            ids = plan["layout"][r][v]
            parts = (["E"] if (r, v) == (0, 0) else []) + ([_ranges(ids)] if ids else [])
            if (r, v) == (plan["pp"] - 1, plan["vpp"] - 1):
                parts.append("L")
            cells.append(f"{' '.join(parts) or '-':<14}")
        lines.append(
            f"  {r:<8}" + "".join(cells) + f"{rank['params']:>18,}{rank['params_per_gpu']:>16,}"
            f"{_gib(rank['bf16_param_bytes_per_gpu']):>14}{_gib(rank['fp32_grad_bytes_per_gpu']):>16}"
        )
    lines += [
        "  (E = embedding, L = final norm + output head + loss; layers are global 0-based indices; "
        "params/GPU divides routed experts over ep)",
        "",
        f"  bf16 params {_human(plan['bf16_param_bytes_total'], 'B')}; bf16 params + fp32 grads "
        f"{_human(plan['param_and_grad_bytes_total'], 'B')} over {plan['world_size']} ranks",
        "",
        *format_cluster(plan),
        "",
        *format_schedule(plan["schedule"]),
    ]
    if "lr_at_tokens" in plan:
        lines += ["", "  lr_at_tokens: " + ", ".join(f"{x:.6g}" for x in plan["lr_at_tokens"])]
    if "search" in plan:
        lines += ["", *format_search(plan["search"], plan["gpu_memory_bytes"])]
    return "\n".join(lines)


def format_cluster(plan: dict[str, Any]) -> list[str]:
    """Cluster, FLOPs, pipeline bubble and memory per GPU of :func:`make_plan`'s dict, as text."""
    c, g, f = plan["cluster"], plan["model_parallel_group"], plan["flops"]
    terms = f["forward_terms_per_token"]
    names = {"mla_projections": "MLA proj", "core_attention": "core attn", "dense_mlp": "dense FFN",
             "router": "router", "routed_experts": "routed experts", "shared_experts": "shared expert",
             "lm_head": "LM head"}
    pipe = plan["pipeline"]
    lines = [
        f"  cluster: {c['nodes']} node{'s' if c['nodes'] != 1 else ''} x {c['gpus_per_node']} GPUs, {c['gpu_memory_gib']:g} GiB and "
        f"{c['peak_tflops']:g} TFLOP/s (BF16 peak) each; model-parallel group {g['shape']} = {g['gpus']} GPUs "
        f"= {g['nodes']:g} node{'s' if g['nodes'] != 1 else ''}, {g['replicas']} replica{'s' if g['replicas'] != 1 else ''} (DP {plan['dp']}); "
        f"the group is reused for any node count that is a multiple of {g['nodes']:g}",
        f"  FLOPs per token (phase {f['phase']}, {f['seq_length']:,}-token sequences): forward "
        f"{_human(f['forward_per_token'])} = " + " + ".join(
            f"{names[k]} {_human(v)}" for k, v in terms.items() if v) +
        f"; training (3x) {_human(plan['flops_per_token'])}; one step of {plan['global_batch_tokens']:,} "
        f"tokens = {f['step_flops']:.4g} FLOPs",
        f"  pipeline ({'interleaved ' if plan['vpp'] > 1 else ''}1F1B{', B/W split' if pipe['split_backward'] else ''},"
        f" phase {pipe['phase']}): pp {plan['pp']} x vpp {plan['vpp']}, {plan['num_microbatches']:,} microbatches "
        f"of {plan['micro_batch_size']} x {plan['seq_length']:,} tokens per DP rank: bubble "
        f"{100 * plan['bubble_fraction']:.2f}% (idle / busy over the PP ranks); estimated step "
        f"{plan['step_time_s_estimated']:.4g} s at {100 * plan['compute_efficiency']:g}% of peak per stage "
        f"(MFU {100 * plan['mfu_estimated']:.1f}%)",
    ]
    if "mfu" in plan:
        lines.append(f"  measured step {plan['step_time_s']:g} s: {plan['model_tflops_per_gpu']:.1f} model TFLOP/s "
                     f"per GPU, MFU {100 * plan['mfu']:.1f}%")
    m = plan["memory_per_gpu_bytes"]
    lines += [
        "",
        f"  memory per GPU, GiB (phase {m['phase']}, {m['seq_length']:,}-token sequences: the fullest; "
        "the fullest DP rank of each PP rank; + host = offloaded to CPU memory)",
        f"  {'pp rank':<8}{'params':>9}{'grads':>9}{'optimizer':>11}{'+ host':>9}{'activations':>13}"
        f"{'+ host':>9}{'in flight':>11}{'total':>9}",
    ]
    for r in plan["pp_ranks"]:
        x = r["memory_bytes"]
        lines.append(
            f"  {r['pp_rank']:<8}{_gib(x['params']):>9}{_gib(x['grads']):>9}{_gib(x['optimizer']):>11}"
            f"{_gib(x['optimizer_offloaded_to_host']):>9}{_gib(x['activations']):>13}"
            f"{_gib(x['activations_offloaded_to_host_peak']):>9}{x['microbatches_in_flight']:>11}"
            f"{_gib(x['total']):>9}"
        )
    verdict = "fits" if plan["fits"] else "does NOT fit"
    lines.append(f"  fullest GPU (pp rank {m['pp_rank']}): {_gib(m['total'])} GiB of {c['gpu_memory_gib']:g} GiB: "
                 f"{verdict}")
    return lines


def format_search(rows: list[dict[str, Any]], capacity: float) -> list[str]:
    """Text table of ``plan.search``'s ranked layouts."""
    lines = [f"  layouts of this cluster ({len(rows)} valid): those that fit first, each group by estimated "
             "step time ('>' = at least: parameters and gradients alone exceed the GPU)",
             f"  {'rank':<6}{'pp':>4}{'vpp':>5}{'ep':>5}{'dp':>6}{'microbatches':>14}{'bubble %':>10}"
             f"{'step s':>9}{'GiB/GPU':>9}  fits  layout"]
    for r in rows:
        lines.append(
            f"  {r['rank']:<6}{r['pp']:>4}{r['vpp']:>5}{r['ep']:>5}{r['dp']:>6}{r['num_microbatches']:>14,}"
            f"{100 * r['bubble_fraction']:>10.2f}{r['step_time_s_estimated']:>9.2f}"
            f"{('>' if r['memory_lower_bound'] else '') + _gib(r['memory_per_gpu_bytes']):>9}  "
            f"{'yes ' if r['fits'] else 'NO  '}  {r['layout']}"
        )
    return lines


def format_schedule(s: dict[str, Any]) -> list[str]:
    """Text table of :meth:`schedules.wsd.Schedule.as_dict`."""
    B = s["global_batch_tokens"]
    lines = [
        f"  schedule {s['name']}: {s['total_steps']:,} steps x {B:,} tokens = {s['total_tokens_exact']:,} "
        f"tokens (nominal {s['total_tokens']:,}); weight decay {s['weight_decay']:g}",
        f"  {'phase':<14}{'style':<12}{'steps':>17}{'nominal tokens':>38}{'lands at (exact)':>38}"
        f"{'LR start -> end':>22}{'ctx':>8}{'seqs':>8}{'mb x n':>10}  rope",
    ]
    for p in s["phases"]:
        steps = f"{p['first_step']:,}-{p['last_step']:,}" if p["steps"] else "skipped"
        nmb = f"{p['micro_batch_size']} x {p['num_microbatches']}" if p["num_microbatches"] else "-"
        lines.append(
            f"  {p['name']:<14}{p['lr_style']:<12}{steps:>17}"
            f"{p['start_tokens']:>19,}{p['end_tokens']:>19,}"
            f"{p['start_tokens_exact']:>19,}{p['end_tokens_exact']:>19,}"
            f"{p['lr_at_start']:>11.3g}{p['lr_at_end']:>11.3g}{p['seq_length']:>8,}"
            f"{p['global_batch_size']:>8,}{nmb:>10}  {p['rope_type']}"
        )
    lines.append("  (a step belongs to the phase holding its first token: a boundary at T tokens lands after "
                 "step ceil(T / tokens per step); LR of step s = LR at s x tokens per step)")
    return lines


# ---------------------------------------------------------------------- entry points


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``k2-plan`` (Hydra overrides in ``argv``). Returns the exit status."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(overrides)
        plan = make_plan(cfg)
        schedule, sim = plan.pop("_schedule"), plan.pop("_sim")
        if cfg.plot:
            from schedules.pipeline_sim import plot_timeline
            from schedules.plot import plot_schedule

            schedule_png = schedule_plot_path(cfg.plot)
            try:
                plot_timeline(sim, cfg.plot, title=(
                    f"{plan['model']} on {plan['world_size']} GPUs: pp {plan['pp']} x vpp {plan['vpp']}, "
                    f"{plan['num_microbatches']} microbatches of {plan['micro_batch_size']} x "
                    f"{plan['seq_length']} tokens, bubble {100 * plan['bubble_fraction']:.2f}%"))
                plot_schedule(schedule, schedule_png)
            except OSError as e:
                raise ConfigError(f"plot={cfg.plot!r}: cannot write the picture ({e})") from None
            print(f"k2-plan: wrote {cfg.plot} (pipeline timeline) and {schedule_png} (schedule)",
                  file=sys.stderr)
    except ConfigError as e:
        print(f"k2-plan: error: {e}", file=sys.stderr)
        return 2
    if cfg.output == "json":
        print(json.dumps(plan))
    else:
        print(format_text(plan))
    return 0


def schedule_plot_path(path: str) -> str:
    """Where ``plot=PATH.png`` puts the schedule picture: ``PATH_schedule.png`` next to the timeline."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem}_schedule.{ext}" if dot and "/" not in ext else f"{path}_schedule.png"


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
