"""One layout analysed (for :func:`k2.launcher.planning.cluster.plan_cluster` and its search): bubble,
estimated step time, memory per GPU and fit of every phase, each
phase simulated with megatron's order, per-stage F / B / W times from the step-time model
(:mod:`k2.launcher.planning.step_time`) on the ``plan.hardware`` profile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k2.config.hardware import peak_tflops
from k2.launcher.planning.checkpoint import staged_bytes_per_node
from k2.launcher.planning.device_memory import device_overheads, gpu_memory
from k2.launcher.planning.ep_overlap import overlap_applies
from k2.launcher.planning.hardware import load_profile
from k2.launcher.planning.memory import StateBytes, state_bytes, state_bytes_lower_bound
from k2.launcher.planning.phase_settings import offloads_anything, phase_memory_settings
from k2.launcher.planning.pipeline_sim import simulate
from k2.launcher.planning.stage_activations import stage_activations
from k2.launcher.planning.step_time import step_time
from k2.launcher.planning.what_if import WhatIf
from k2.model.flops import flops_per_token

if TYPE_CHECKING:
    from k2.config.schema import K2Config


def main_phase(schedule):
    """The phase that runs the most steps (bubble, FLOPs and step time are reported for it)."""
    running = [p for p in schedule.phases if p.steps]
    return max(running, key=lambda p: (p.steps, -p.index))


def stage_costs(fl, dims, tokens: int, tflops: float, recompute=()) -> tuple[list, list, list]:
    """Per virtual stage (pipeline order) the seconds of one microbatch's forward (F), input gradient (B)
    and weight gradient (W), from the model FLOPs of the stage's layers (:mod:`k2.model.flops`; the LM head
    on the loss stage, the embedding lookup costs 0) at ``tflops`` TFLOP/s.

    B = the weight GEMMs' forward FLOPs + twice core attention's (it has no weights) + the FLOPs of recomputed
    GEMMs (``memory.recompute``: ``mla_up_proj`` redoes the q/kv up-projections, ``moe_down_proj`` the routed
    experts' down-projection, ``layer`` the whole layer's forward); W = the weight GEMMs' forward FLOPs.
    """
    rate = tflops * 1e12
    F, B, W = [], [], []
    whole = "layer" in recompute  # the layer's forward again (its selective sites act in the re-run too)
    up = fl.attention_up_proj if "mla_up_proj" in recompute else 0
    down = fl.routed_experts / 3 if "moe_down_proj" in recompute else 0  # fc2 = 1/3 of the SwiGLU GEMMs
    for v in range(dims.vpp):
        for r in range(dims.pp):
            f = b = w = 0.0
            for i in dims.stage_layers[r][v]:
                gemm = fl.layer_gemm(i)
                f += fl.layer(i)
                b += gemm + 2 * fl.attention_core + up + (down if fl.moe_pattern[i] else 0)
                b += fl.layer(i) if whole else 0
                w += gemm
            if dims.stage_has_loss(r, v):
                f, b, w = f + fl.lm_head, b + fl.lm_head, w + fl.lm_head
            F.append(f * tokens / rate)
            B.append(b * tokens / rate)
            W.append(w * tokens / rate)
    return F, B, W


#: nodes per NVLink segment on a multi-host domain when ``cluster.segment_nodes`` is null and the job
#: spans racks: NVIDIA's recommended Slurm ``--segment`` for jobs of 128+ GPUs on GB200 NVL72 (16 trays)
DEFAULT_SEGMENT_NODES = 16


def cluster_profile(cfg: K2Config):
    """The hardware profile ``plan.hardware`` names, on ``cluster.gpus_per_node`` GPUs per host: the
    cluster's node is a host (its memory, its CPUs); the NVLink domain, which decides the links a group
    crosses, is the node, or where the profile's ``nvlink_domain_gpus`` spans hosts (an NVL72 rack) the
    job's part of one (:func:`job_domain_gpus`).

    Raises:
        ConfigError: ``cluster.gpus_per_node`` above the GPUs of the profile's host (8 on a GB200 tray of
            4); ``cluster.segment_nodes`` holds more GPUs than the profile's NVLink domain;
            ``train.fp8_recipe`` is one the profile's tensor cores do not run (``fp8_recipes``: MXFP8 on
            Hopper).
    """
    import dataclasses

    from k2.config.errors import ConfigError

    gpn = int(cfg.cluster.gpus_per_node)
    prof = load_profile(str(cfg.plan.hardware))
    if prof.compute_units is not None and gpn > prof.gpus_per_host:  # (a GPU's host; a CPU profile's ranks may vary)
        raise ConfigError(
            f"cluster.gpus_per_node={gpn}: a host of plan.hardware={prof.name} carries {prof.gpus_per_host} GPUs; "
            f"allowed: 1 to {prof.gpus_per_host}"
        )
    prof = dataclasses.replace(prof, gpus_per_host=gpn)
    fp8 = cfg.train.fp8_recipe
    if fp8 is not None and prof.fp8_recipes and str(fp8) not in prof.fp8_recipes:
        runs = ", ".join(prof.fp8_recipes)
        raise ConfigError(
            f"train.fp8_recipe={fp8}: plan.hardware={prof.name} ({prof.gpu or 'its GPU'}) runs {runs} only; "
            f"allowed: {runs}, or null (the GEMMs in train.precision)"
        )
    if prof.nvlink_domain_gpus and prof.nvlink_domain_gpus > gpn:
        prof = dataclasses.replace(prof, nvlink_domain_gpus=job_domain_gpus(cfg, prof.nvlink_domain_gpus))
    return prof


def job_domain_gpus(cfg: K2Config, domain: int) -> int:
    """The GPUs of the job that share one NVLink domain of ``domain`` GPUs spanning hosts: ``cluster.
    segment_nodes`` x ``cluster.gpus_per_node``; null: the whole job when it fits one domain, else segments
    of :data:`DEFAULT_SEGMENT_NODES` nodes where they divide the job and fit a domain, else the largest
    node count that does (18 for whole NVL72 racks of 4-GPU trays)."""
    from k2.config.errors import ConfigError

    gpn, nodes, seg = int(cfg.cluster.gpus_per_node), int(cfg.cluster.nodes), cfg.cluster.segment_nodes
    if seg is None:
        if nodes * gpn <= domain:
            return domain
        fits = [n for n in range(max(1, domain // gpn), 0, -1) if nodes % n == 0]
        return gpn * (DEFAULT_SEGMENT_NODES if DEFAULT_SEGMENT_NODES in fits else fits[0])
    if int(seg) * gpn > domain:
        raise ConfigError(
            f"cluster.segment_nodes={seg}: {seg} x cluster.gpus_per_node={gpn} GPUs exceed plan.hardware's "
            f"NVLink domain of {domain} GPUs; allowed: 1 to {domain // gpn}, or null"
        )
    return int(seg) * gpn


#: host memory per node planned with when neither ``cluster.host_memory_gib`` nor the profile names one
#: (GiB): the 2 TB of an 8-GPU HGX / DGX H100-class node
DEFAULT_HOST_MEMORY_GIB = 2048.0


def host_memory_gib(cfg: K2Config) -> float:
    """Host memory of one node that ``k2-plan`` (and ``k2-train``'s check) plans with, GiB:
    ``cluster.host_memory_gib`` when set, else the profile's ``host_memory_gib`` per host scaled to
    ``cluster.gpus_per_node`` GPUs (the same memory per GPU), else :data:`DEFAULT_HOST_MEMORY_GIB`."""
    if cfg.cluster.host_memory_gib is not None:
        return float(cfg.cluster.host_memory_gib)
    prof = load_profile(str(cfg.plan.hardware))
    if prof.host_memory_gib is None:
        return DEFAULT_HOST_MEMORY_GIB
    return float(prof.host_memory_gib) * int(cfg.cluster.gpus_per_node) / prof.gpus_per_host


#: GPU memory planned with when neither ``cluster.gpu_memory_gib`` nor the profile names one (GiB)
DEFAULT_GPU_MEMORY_GIB = 80.0


def gpu_memory_assumed(cfg: K2Config) -> bool:
    """True when neither ``cluster.gpu_memory_gib`` nor the profile gives the GPU's memory, so that
    :func:`gpu_memory_gib` plans with :data:`DEFAULT_GPU_MEMORY_GIB` (the plan says so)."""
    return cfg.cluster.gpu_memory_gib is None and not cluster_profile(cfg).gpu_memory_gib


def gpu_memory_gib(cfg: K2Config) -> float:
    """The memory of one GPU that ``k2-plan`` plans with, GiB: ``cluster.gpu_memory_gib`` when set, else
    the one ``plan.hardware``'s profile names (an H200's 141), else :data:`DEFAULT_GPU_MEMORY_GIB`."""
    if cfg.cluster.gpu_memory_gib is not None:
        return float(cfg.cluster.gpu_memory_gib)
    return cluster_profile(cfg).gpu_memory_gib or DEFAULT_GPU_MEMORY_GIB


def flops_only_step_time(cfg: K2Config, dims, phase, recompute=()) -> float:
    """The step time of the FLOPs-only estimate (model FLOPs at the device peak,
    :func:`k2.config.hardware.peak_tflops`, x ``plan.compute_efficiency`` per stage, the simulated bubble,
    no communication): what ``k2-plan`` reported before the performance model, kept for comparison
    (``step_time_s_flops_only``)."""
    tflops = peak_tflops(cfg) * float(cfg.plan.compute_efficiency)
    fl = flops_per_token(cfg.model, phase.seq_length)
    F, B, W = stage_costs(fl, dims, phase.seq_length * phase.micro_batch_size, tflops, recompute)
    return simulate(
        dims.pp, dims.vpp, phase.num_microbatches, F, B, W, decouple_wgrad=bool(cfg.pipeline.decouple_wgrad)
    ).makespan


def _settings_key(mem) -> tuple:
    if mem is None:
        return ()
    get = (lambda k: mem.get(k)) if hasattr(mem, "get") else (lambda k: getattr(mem, k, None))
    return tuple(tuple(sorted(get(k) or ())) for k in ("fp8_store", "recompute", "offload"))


def pp_rank_of(rank: int, dims) -> int:
    """PP rank of global rank ``rank``: megatron-core's rank order ``tp-cp-ep-dp-pp`` (``RankGenerator``'s
    default, the one :func:`k2.parallel.distributed.init_distributed` uses) puts PP outermost."""
    return rank // (dims.world_size // dims.pp)


def host_bytes_per_node(memory: list, dims, gpus_per_node: int) -> float:
    """The most host bytes any node holds: the sum, over the node's ``gpus_per_node`` consecutive ranks, of
    each GPU's offloaded bytes as pinned buffers hold them (the fullest DP rank of its PP rank,
    :attr:`k2.launcher.planning.device_memory.GpuMemory.host_pinned`)."""
    nodes = max(1, dims.world_size // gpus_per_node)
    return max(
        sum(
            memory[pp_rank_of(r, dims)].host_pinned
            for r in range(n * gpus_per_node, min((n + 1) * gpus_per_node, dims.world_size))
        )
        for n in range(nodes)
    )


def staged_pinned_ratio(states) -> float:
    """Pinned over raw bytes of what a GPU stages for a checkpoint (its parameters and optimizer tensors,
    one pinned buffer each: :mod:`k2.launcher.planning.host_pinned`), for the fullest GPU; 1 when the
    states carry no per-tensor figures (the search's lower bound)."""
    worst = max((x for row in states for x in row), key=lambda x: x.params + x.grads + x.optimizer)
    raw = worst.param_numel * (worst.params / max(worst.buffer_numel, worst.param_numel, 1)) + worst.optimizer
    pinned = worst.params_pinned + worst.optimizer_pinned
    return pinned / raw if pinned and raw else 1.0


def analyse_layout(
    cfg: K2Config,
    dims,
    counts,
    schedule,
    *,
    max_microbatches: int | None = None,
    cache: dict | None = None,
    prune: bool = False,
) -> dict[str, Any]:
    """Bubble, estimated step time, memory per GPU and host per node, and the fit, of every phase of one
    layout (``k2-plan`` and its search).

    Every phase that runs a step is planned with its own context length, microbatch and ``memory.*`` settings
    (:func:`phase_memory_settings`); phases with the same ones share one simulation. Each is simulated with
    megatron's order (:func:`k2.launcher.planning.pipeline_sim.simulate`, stage times and the terms after the
    pipeline from :func:`k2.launcher.planning.step_time.step_time` on :func:`cluster_profile`); memory
    (:mod:`k2.launcher.planning.memory`, :mod:`k2.launcher.planning.stage_activations`) is the fullest GPU of
    each PP rank, host memory the fullest node (:func:`host_bytes_per_node`, plus the copy an asynchronous
    checkpoint save stages there: :func:`k2.launcher.planning.checkpoint.staged_bytes_per_node`). The layout
    fits only when every phase fits both the GPU memory (:func:`gpu_memory_gib`) and the host memory per node
    (:func:`host_memory_gib`).

    With ``max_microbatches`` (the search), at most that many microbatches are simulated (a multiple of
    pp) and the rest of the step is extrapolated at the busiest rank's per-microbatch time; exact for
    equal stages, and the peak in flight is reached by then (the warm-up is < 2 pp + (vpp-1) pp
    forwards). ``cache`` is handed to :func:`k2.launcher.planning.memory.state_bytes`. With ``prune``, a layout
    whose parameters and gradients alone exceed the GPU memory gets the cheap lower bound
    (:func:`k2.launcher.planning.memory.state_bytes_lower_bound`; ``"memory_lower_bound": True``) instead of its
    megatron buffer layouts.

    Returns:
        a dict: ``main_phase`` / ``main`` (the phase running the most steps and its result), ``worst`` /
        ``worst_gpu`` (the phase with the fullest GPU), ``phases`` (one row per running phase, in order:
        :func:`_phase_row`), ``fits``, ``capacity_bytes``, ``host_capacity_bytes``, ``results``, ``states``,
        ``memory_lower_bound``, ``staged_pinned_ratio`` (:func:`staged_pinned_ratio`).
    """

    profile = cluster_profile(cfg)
    staged = staged_bytes_per_node(cfg, counts.total, dims.world_size)  # an async save's host copy
    capacity = gpu_memory_gib(cfg) * 2**30
    host_capacity = host_memory_gib(cfg) * 2**30
    states, lower_bound = _layout_states(cfg, dims, counts, capacity, cache=cache, prune=prune)
    ratio = staged_pinned_ratio(states)
    staged *= ratio  # (staged into pinned buffers, one per tensor)
    main = main_phase(schedule)
    results, keys = _simulate_phases(
        cfg, dims, counts, schedule, states, profile=profile, max_microbatches=max_microbatches, host_staged=staged
    )
    phases = [
        _phase_row(p, results[keys[p.index]], capacity, host_capacity, lower_bound) for p in schedule.phases if p.steps
    ]
    main_res = results[keys[main.index]]
    worst_key = max(results, key=lambda k: max(g.total for g in results[k]["memory"]))
    worst = results[worst_key]
    worst_gpu = max(worst["memory"], key=lambda g: g.total)
    return {
        "main_phase": main,
        "main": main_res,
        "worst": worst,
        "worst_gpu": worst_gpu,
        "fits": all(row["fits"] for row in phases),
        "capacity_bytes": capacity,
        "host_capacity_bytes": host_capacity,
        "phases": phases,
        "results": results,
        "states": states,
        "memory_lower_bound": lower_bound,
        "staged_pinned_ratio": ratio,
    }


def _layout_states(
    cfg: K2Config, dims, counts, capacity: float, *, cache: dict | None, prune: bool
) -> tuple[list[list[StateBytes]], bool]:
    """The layout's training state per GPU (``out[pp_rank][dp_rank]``) and whether it is only the lower bound:
    with ``prune``, a layout whose parameters and gradients alone exceed ``capacity`` (bytes) keeps
    :func:`k2.launcher.planning.memory.state_bytes_lower_bound`; else megatron's buffer layouts
    (:func:`k2.launcher.planning.memory.state_bytes`, ``cache`` handed to it)."""
    states = state_bytes_lower_bound(counts, dims, precision=cfg.train.precision) if prune else None
    lower_bound = bool(states) and max(x.params + x.grads for row in states for x in row) > capacity
    if not lower_bound:
        states = state_bytes(
            counts,
            dims,
            precision=cfg.train.precision,
            optim=cfg.optim,
            use_distributed_optimizer=bool(cfg.parallel.use_distributed_optimizer),
            model_cfg=cfg.model,
            cache=cache,
        )
    return states, lower_bound


def _simulate_phases(
    cfg: K2Config, dims, counts, schedule, states, *, profile, max_microbatches: int | None, host_staged: float
) -> tuple[dict[Any, dict], dict[int, Any]]:
    """:func:`_simulate_phase` of each phase that runs a step, once per distinct (context length, microbatch,
    microbatches, memory settings). Returns ``(results, keys)``: the result per key (``"phases"`` naming the
    phases that share it) and the key of each phase's index."""
    results: dict[Any, dict] = {}
    keys = {}
    for phase in [p for p in schedule.phases if p.steps]:
        settings = phase_memory_settings(cfg, phase)
        key = (phase.seq_length, phase.micro_batch_size, phase.num_microbatches, _settings_key(settings))
        keys[phase.index] = key
        if key in results:
            results[key]["phases"].append(phase.name)
            continue
        results[key] = _simulate_phase(
            cfg,
            dims,
            counts,
            phase,
            settings,
            states,
            profile=profile,
            max_microbatches=max_microbatches,
            host_staged=host_staged,
        )
    return results, keys


def _simulate_phase(
    cfg: K2Config, dims, counts, phase, settings, states, *, profile, max_microbatches: int | None, host_staged: float
) -> dict[str, Any]:
    """One phase of :func:`analyse_layout` with its memory ``settings``: its activations, step time
    (:func:`k2.launcher.planning.step_time.step_time`), bubble, the fullest GPU of each PP rank
    (``states``: the layout's training state) and the fullest node's host bytes (``host_staged``: an
    asynchronous save's copy)."""
    recompute = _settings_key(settings)[1] if settings is not None else ()
    fl = flops_per_token(cfg.model, phase.seq_length)
    tokens = phase.seq_length * phase.micro_batch_size
    acts = stage_activations(
        cfg.model,
        dims,
        seq_length=phase.seq_length,
        micro_batch_size=phase.micro_batch_size,
        precision=cfg.train.precision,
        memory_cfg=settings,
        fused_kernels=True,
    )
    overlap, why = overlap_applies(cfg, dims, recompute, WhatIf.from_config(cfg))
    microbatches = phase.num_microbatches
    st = step_time(
        cfg,
        dims,
        counts,
        fl,
        tokens=tokens,
        num_microbatches=microbatches,
        recompute=recompute,
        offload_bytes=[a.host for a in acts],
        activation_bytes=[a.gpu for a in acts],
        profile=profile,
        max_microbatches=max_microbatches,
        ep_overlap=overlap,
        pair_transient_bytes=[a.layer_gpu_max for a in acts],
    )
    sim, makespan = st.sim, st.step_s
    busy = st.busy or [
        microbatches
        * sum(st.F[v * dims.pp + r] + st.B[v * dims.pp + r] + st.W[v * dims.pp + r] for v in range(dims.vpp))
        for r in range(dims.pp)
    ]
    mem = gpu_memory(
        states,
        acts,
        sim,
        dims,
        float(cfg.optim.offload_fraction),
        device_overheads(cfg, dims, phase.seq_length, phase.micro_batch_size),
    )
    return {
        "phases": [phase.name],
        "sim": sim,
        "makespan": makespan,
        "step_time": st,
        "bubble": (dims.pp * st.makespan - sum(busy)) / sum(busy),
        "memory": mem,
        "flops": fl,
        "tokens_per_microbatch": tokens,
        "num_microbatches": microbatches,
        "memory_settings": settings,
        "recompute_s": st.recompute_s,
        "ep_overlap": st.ep_overlap,
        "ep_overlap_note": why,
        "host_per_node": host_bytes_per_node(mem, dims, int(cfg.cluster.gpus_per_node)) + host_staged,
    }


def _settings(mem) -> dict:
    keys = ("fp8_store", "recompute", "offload")
    return dict(zip(keys, (list(x) for x in _settings_key(mem)))) if mem is not None else {k: [] for k in keys}


def _phase_row(phase, res: dict, capacity: float, host_capacity: float, lower_bound: bool) -> dict[str, Any]:
    """One phase of the plan (JSON ``phases``): its fullest GPU, the host memory of its fullest node, the
    fit of both, its estimated step time, its breakdown (:class:`k2.launcher.planning.step_time.StepTime`)
    and what recompute adds to it. Bytes and seconds."""
    gpu = max(res["memory"], key=lambda g: g.total)
    fits_gpu = gpu.total <= capacity and not lower_bound
    fits_host = res["host_per_node"] <= host_capacity
    return {
        "phase": phase.name,
        "steps": phase.steps,
        "seq_length": phase.seq_length,
        "micro_batch_size": phase.micro_batch_size,
        "num_microbatches": phase.num_microbatches,
        "memory": _settings(res["memory_settings"]),
        "device_peak_bytes": gpu.total,
        "device_pp_rank": gpu.pp_rank,
        "activation_bytes": gpu.activations,
        "microbatches_in_flight": gpu.in_flight,
        "host_bytes_per_gpu_peak": max(g.host_pinned for g in res["memory"]),
        "host_bytes_per_node": res["host_per_node"],
        "fits_gpu": fits_gpu,
        "fits_host": fits_host,
        "fits": fits_gpu and fits_host,
        "step_time_s_estimated": res["makespan"],
        "recompute_time_s_estimated": res["recompute_s"],
        "step_time_breakdown_s": dict(res["step_time"].breakdown),
        "ep_overlap": res["ep_overlap"],
        "ep_overlap_note": res["ep_overlap_note"],
        "ep_comm_s": res["step_time"].ep_comm,
    }


def check_host_memory(cfg: K2Config, dims, schedule) -> None:
    """``k2-train``'s check, before any process group starts, that every phase's host memory per node
    (offloaded optimizer states + the peak of offloaded activations, :func:`analyse_layout`'s
    ``host_bytes_per_node``) fits the host memory of a node (:func:`host_memory_gib`). A run that offloads
    nothing is not planned (its host bytes are 0). ``k2-plan`` reports the same figures as ``fits: false``
    instead of an error.

    Raises:
        ConfigError: naming ``cluster.host_memory_gib``, the phase, the GiB it needs per node and the GiB
            available.
    """
    from k2.config.errors import ConfigError
    from k2.model.params import count_params

    if not offloads_anything(cfg, schedule):
        return
    a = analyse_layout(cfg, dims, count_params(cfg), schedule)
    worst = max(a["phases"], key=lambda row: row["host_bytes_per_node"])
    if not worst["fits_host"]:
        need, have = worst["host_bytes_per_node"] / 2**30, host_memory_gib(cfg)
        gib = lambda x: f"{x:,.1f}" if x >= 1 else f"{x:.3g}"  # noqa: E731
        raise ConfigError(
            f"cluster.host_memory_gib={have:g}: phase '{worst['phase']}' needs {gib(need)} GiB of host memory "
            f"per node ({int(cfg.cluster.gpus_per_node)} GPUs: offloaded optimizer states and activations, the "
            "staged copy of an asynchronous checkpoint save), "
            f"{gib(have)} GiB available (allowed: cluster.host_memory_gib >= {gib(need)}, or offload less: "
            "memory.offload, optim.offload_fraction)"
        )
