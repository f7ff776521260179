"""``k2-plan``'s step time from a performance model: kernels, communication, recompute, offload, the
optimizer and the pipeline bubble, per term, on a hardware profile (:mod:`k2.launcher.planning.hardware`).

Per virtual stage and microbatch of ``T = micro_batch_size x seq_length`` tokens (one GPU, TP = 1; a layer's
costs: :mod:`k2.launcher.planning.stage_model`):

* **GEMMs** at their shapes (:mod:`k2.model.kernels`: roofline, tile and wave quantization, a launch cost
  each): MLA's projections ``[T, h] x [h, r_q]`` ..., the dense / shared SwiGLU, the router, the routed
  experts as one grouped GEMM of ``E / ep`` experts of ``T k ep / E`` tokens each (balanced routing;
  megatron's sequential loop of ``E / ep`` GEMMs where ``model.moe_grouped_gemm`` is off, the CPU default),
  the LM head. Backward: the input gradient ``[T, n] x [n, k]`` (B) and the weight gradient ``[k, T] x [T,
  n]`` (W) of each.
* **Core attention** at the profile's attention rate, backward twice the forward's FLOPs.
* **Non-GEMM kernels** (norms, RoPE, q/k assembly, SwiGLU, router scores and top-k, token permutation,
  residual adds, the loss): the bytes each reads and writes (``stage_model.nongemm_bytes_per_token``) at the
  profile's achieved memory bandwidth, plus a launch cost per operator (``operator_counts.OPERATORS``, counted on
  k2-train's modules, forward and backward apart); the backward of an element-wise kernel reads its
  saved input and the output gradient and writes the input gradient: 1.5 x the forward's bytes. The
  first stage adds the word embedding (its gather, its dense gradient). Real kernels are slower than
  this roofline (unfused FP32 upcasts, several passes): a GPU profile's ``nongemm_share`` (0.27:
  DeepSeek-V3's published training profile) sets the least share of a pass's compute stream they take.
* **EP all-to-all**: dispatch and combine per MoE layer in the forward and again in the backward
  (:func:`k2.launcher.planning.comm.ep_alltoall`). Overlap rules: the trainer's schedule (megatron's
  (interleaved) 1F1B with the ``alltoall`` dispatcher) runs them on the compute stream between the
  expert GEMMs, so they are **exposed**; with ``pipeline.ep_overlap`` (megatron's combined 1F1B, in the
  phases and layouts where it runs: :func:`k2.launcher.planning.ep_overlap.overlap_applies`) each steady
  1F1B step runs one microbatch's forward with another's backward on a compute and a communication
  stream, and only the compute stream's waits are exposed (:mod:`k2.launcher.planning.ep_overlap`);
  the DualPipe what-if hides them behind the paired microbatch's compute (DeepSeek-V3, arXiv 2412.19437
  section 3.2.1), with 20 of 132 SMs given to communication (section 3.2.2) so compute runs at 112/132
  of its rates.
* **Recompute** (``memory.recompute``): the sites' forward work again in the backward (``layer``: the whole
  forward, its all-to-alls included).
* **Activation offload** (``memory.offload``): the stage's offloaded bytes go out during the forward and
  back during the backward on a copy stream (its own engine and PCIe path); only what exceeds the pass's
  time (compute and all-to-alls) is exposed.
* **The schedule's own work** (``schedule``): a measured CPU profile's cost of megatron's schedule and the
  trainer's step functions beyond the model's operators, per microbatch and virtual stage and per step.
* **PP sends**: ``T x h`` activations per stage boundary, across nodes when PP ranks are on different nodes,
  as the simulator's ``p2p_time``.

The pipeline: megatron's (interleaved) 1F1B order simulated with these per-stage times
(:func:`k2.schedules.pipeline_sim.simulate`; with the EP overlap its combined order, a steady pair one
operation); the **bubble** is the busiest PP rank's idle time in it
(with the DualPipe what-if, PP rank r runs stage r and stage PP - 1 - r, half the microbatches each, and
DualPipe's bubble ``(PP/2 - 1)(F&B + B - 3W)``, arXiv 2412.19437 table 2).
After the pipeline: the **DP gradient reduce-scatter** (FP32, megatron's ZeRO-1 buffers) and **parameter
all-gather** (BF16), exposed (``overlap_grad_reduce`` / ``overlap_param_gather`` are off in ``k2-train``;
the ``fsdp`` what-if: per pipeline flush, :func:`k2.launcher.planning.comm.fsdp_exposed`), and the
**optimizer step** (:mod:`k2.launcher.planning.optimizer_time`).

What-if settings (``plan.what_if.*``), for comparing with published runs only (``k2-train`` has none of
them; :mod:`k2.launcher.planning.what_if`): ``fp8_gemm`` (GEMMs at the FP8 rate), ``fsdp`` (FSDP2 under
torch's pipelining: :func:`k2.launcher.planning.comm.fsdp_exposed`), ``dualpipe``,
``deepep`` (FP8 dispatch when ``fp8_gemm``, a token crosses to each remote node once: NVLink forwarding),
``node_limit`` (DeepSeek-V3's routing to at most M nodes), ``pipeline_flushes`` (gradient accumulation over
that many pipeline schedules, each with its own fill and drain), ``mtp_layers`` (multi-token-prediction
modules on the stage holding the loss: :meth:`StageModel.mtp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k2.launcher.planning.comm import crosses_nodes, fsdp_exposed, host_copy_seconds, p2p_seconds, ring_seconds
from k2.launcher.planning.ep_overlap import (A2A_KINDS, OverlapCosts, ep_summary, extrapolate, overlap_applies,
                                            rank_costs, stage_plans)
from k2.launcher.planning.hardware import HardwareProfile
from k2.launcher.planning.optimizer_time import optimizer_time
from k2.launcher.planning.stage_model import StageModel, _add
from k2.launcher.planning.what_if import WhatIf, tp_group_profile
from k2.schedules.pipeline_sim import simulate

DEEPSEEK_COMM_SMS = 20  # SMs DeepSeek-V3 gives to communication out of 132 (arXiv 2412.19437 section 3.2.2)

TERMS = ("gemm", "attention", "non_gemm", "ep_comm", "recompute", "offload", "schedule")


@dataclass
class StepTime:
    """One step's time and its breakdown on the busiest PP rank (seconds).

    Attributes:
        step_s: the step's seconds.
        breakdown: seconds per term: compute by kind (``gemm``, ``attention``, ``non_gemm``), exposed
            communication by kind (``ep_comm``, ``pp_p2p`` within ``bubble``, ``dp_grad_reduce_scatter``,
            ``dp_param_all_gather``, ``muon_gather``), ``recompute``, ``offload`` (exposed host copies of
            activations), ``bubble`` (idle time of the busiest PP rank in the simulated schedule, its waits
            for PP sends included), ``optimizer`` (Newton-Schulz + update) and ``optimizer_offload``. They
            sum to ``step_s``.
        F, B, W: per virtual stage the seconds of one microbatch's forward / input gradient / weight
            gradient (what the simulator ran).
        p2p_s: one PP send.
        sim: the simulated pipeline (:class:`k2.schedules.pipeline_sim.PipelineResult`).
        makespan: the pipeline's seconds (extrapolated past the simulated microbatches).
        recompute_s: what recompute adds (``breakdown['recompute']``).
        what_if: the what-if settings' labels.
        ep_overlap: whether the step ran megatron's combined 1F1B (``pipeline.ep_overlap`` where it applies).
        ep_comm: the EP all-to-alls of the busiest rank's step, exposed and hidden
            (:func:`k2.launcher.planning.ep_overlap.ep_summary`); None without EP (or with the DualPipe
            what-if).
        busy: with the overlap, per PP rank the seconds of its steps (the bubble is the rest).
    """

    step_s: float
    breakdown: dict[str, float]
    F: list
    B: list
    W: list
    p2p_s: float
    sim: Any
    makespan: float
    recompute_s: float
    what_if: list = field(default_factory=list)
    ep_overlap: bool = False
    ep_comm: dict | None = None
    busy: list | None = None


def _stage_totals(model: StageModel, layers: list[int], has_loss: bool, cache: dict,
                  has_embedding: bool = False) -> dict:
    """Seconds per pass and term of one microbatch on a virtual stage holding ``layers`` (+ the embedding,
    the loss).
    Layers of one kind cost the same: ``cache`` keeps one per kind."""
    tot = {"F": {}, "B": {}, "W": {}}
    parts = []
    for i in layers:
        key = int(model.fl.moe_pattern[i])
        if key not in cache:
            cache[key] = model.layer(i)
        parts.append(cache[key])
    if has_embedding:
        if "embedding" not in cache:
            cache["embedding"] = model.embedding()
        parts.append(cache["embedding"])
    if has_loss:
        if "loss" not in cache:
            cache["loss"] = model.loss()
        parts.append(cache["loss"])
        if model.wi.mtp_layers:
            if "mtp" not in cache:
                cache["mtp"] = model.mtp()
            parts += [cache["mtp"]] * model.wi.mtp_layers
    for p in parts:
        for ph in tot:
            for k, v in p[ph].items():
                _add(tot[ph], k, v)
    return tot


def _hide_behind(comm: float, compute: float) -> float:
    return max(0.0, comm - compute)


@dataclass
class _Pipeline:
    """The simulated pipeline of one step on the busiest PP rank (:func:`_plain_pipeline`,
    :func:`_overlap_pipeline`): terms by kind (``bubble`` included), the EP all-to-all detail."""

    sim: Any
    F: list
    B: list
    W: list
    makespan: float
    busiest: int
    breakdown: dict
    ep: dict | None
    busy: list | None = None


def step_time(cfg, dims, counts, fl, *, tokens: int, num_microbatches: int, recompute=(), offload_bytes=None,
              activation_bytes=None, profile: HardwareProfile, max_microbatches: int | None = None,
              ep_overlap: bool | None = None, pair_transient_bytes=None) -> StepTime:
    """The step time of one phase on one layout, with its breakdown (module docstring).

    Args:
        cfg: the config (``model``, ``optim``, ``train.precision``, ``pipeline.decouple_wgrad``,
            ``pipeline.ep_overlap``, ``plan.what_if``, ``model.moe_grouped_gemm``).
        dims: :class:`k2.parallel.dims.ParallelDims`.
        counts: :class:`k2.model.params.ModelParams` (parameters per GPU for the DP traffic and optimizer).
        fl: :class:`k2.model.flops.FlopsPerToken` at the phase's context length.
        tokens: tokens per microbatch (``micro_batch_size x seq_length``).
        num_microbatches: microbatches per step per DP rank.
        recompute: ``memory.recompute`` sites of the phase.
        offload_bytes: per virtual stage the bytes one microbatch offloads to the host (None = 0).
        activation_bytes: per virtual stage the GPU bytes one microbatch keeps (for the simulator).
        profile: the :class:`HardwareProfile`.
        max_microbatches: simulate at most this many (a multiple of pp) and extrapolate the rest at the
            busiest rank's per-microbatch time (``plan.search``).
        ep_overlap: run megatron's combined 1F1B (:mod:`k2.launcher.planning.ep_overlap`); None = where
            :func:`k2.launcher.planning.ep_overlap.overlap_applies` says the trainer runs it.
        pair_transient_bytes: per virtual stage the GPU bytes a combined pair holds beyond its
            microbatches (its largest layer's; :func:`k2.schedules.pipeline_sim.simulate`).

    Returns:
        :class:`StepTime`.
    """
    wi = WhatIf.from_config(cfg)
    gpu_profile = profile
    if wi.tp > 1:
        profile = tp_group_profile(profile, wi.tp)
    precision = str(cfg.train.precision)
    fraction = (132 - DEEPSEEK_COMM_SMS) / 132 if wi.dualpipe else 1.0
    rates = profile.rates(precision, fp8_gemm=wi.fp8_gemm, compute_fraction=fraction)
    act_bytes = 4.0 if precision == "fp32" else 2.0
    grouped = cfg.model.get("moe_grouped_gemm") if hasattr(cfg.model, "get") else None
    grouped = (precision == "bf16") if grouped is None else bool(grouped)
    model = StageModel(cfg.model, fl, dims, tokens=tokens, profile=profile, rates=rates, act_bytes=act_bytes,
                        grouped=grouped, what_if=wi, recompute=recompute)
    # sequence-parallel TP (what-if): 2 all-gathers + 2 reduce-scatters of T x h per layer and pass, NVLink
    model.tp_comm = 4 * ring_seconds(tokens * model.s["h"] * act_bytes, wi.tp, False, gpu_profile) if wi.tp > 1 else 0.0
    S = dims.pp * dims.vpp
    cache: dict = {}
    kinds = [_stage_totals(model, dims.layout[r][v], dims.stage_has_loss(r, v), cache, dims.stage_has_embedding(r, v))
             for v in range(dims.vpp) for r in range(dims.pp)]
    # the schedule's own work per microbatch and virtual stage (a measured CPU profile), half in each pass
    for st in kinds:
        for ph in ("F", "B"):
            _add(st[ph], "schedule", profile.microbatch_overhead_us * 1e-6 / 2)
    # offloaded activations: out during F, back during B, hidden behind the pass's compute
    copies = [host_copy_seconds(b, profile) for b in (offload_bytes if offload_bytes is not None else [0.0] * S)]
    for st, t in zip(kinds, copies):
        st["F"]["offload"] = _hide_behind(t, sum(st["F"].values()))
        st["B"]["offload"] = _hide_behind(t, sum(st["B"].values()) + sum(st["W"].values()))
    if wi.dualpipe:  # EP traffic overlapped with the paired microbatch's opposite pass
        for st in kinds:
            f_comp = sum(x for k, x in st["F"].items() if k not in ("ep_comm", "offload"))
            b_comp = sum(x for k, x in st["B"].items() if k not in ("ep_comm", "offload")) + sum(st["W"].values())
            st["F"]["ep_comm"] = _hide_behind(st["F"].get("ep_comm", 0.0), b_comp)
            st["B"]["ep_comm"] = _hide_behind(st["B"].get("ep_comm", 0.0), f_comp)
    costs = None
    if dims.ep > 1 and model.s["E"] and not wi.dualpipe:  # the all-to-alls by kind (and the overlap's steps)
        costs = OverlapCosts(stage_plans(model, dims, profile.microbatch_overhead_us * 1e-6 / 2, copies),
                             profile.comm_stream, bool(cfg.pipeline.decouple_wgrad))
    world_span = dims.world_size // dims.pp
    # consecutive PP ranks are world / pp ranks apart: on other nodes once that is a node or more
    p2p = p2p_seconds(tokens * model.s["h"] * act_bytes, world_span >= profile.gpus_per_node, profile)
    # per pipeline flush (what-if pipeline_flushes; a flush keeps at least pp microbatches)
    flushes = max(1, min(wi.pipeline_flushes, num_microbatches // dims.pp))
    m = -(-num_microbatches // flushes)
    m_sim = (m if max_microbatches is None or m <= max_microbatches
             else max(dims.pp, max_microbatches // dims.pp * dims.pp))
    sim_args = dict(m=m, m_sim=m_sim, flushes=flushes, p2p=p2p if dims.pp > 1 else 0.0,
                    activation_bytes=activation_bytes)
    if ep_overlap is None:
        ep_overlap = overlap_applies(cfg, dims, recompute, wi)[0]
    if ep_overlap and costs is not None:
        pipe = _overlap_pipeline(cfg, dims, costs, pair_transient_bytes=pair_transient_bytes, **sim_args)
    else:
        pipe = _plain_pipeline(cfg, dims, kinds, wi, costs, num_microbatches=num_microbatches, **sim_args)
    breakdown = {k: 0.0 for k in TERMS + (("tp_comm",) if wi.tp > 1 else ())}
    for k, v in pipe.breakdown.items():
        breakdown[k] = breakdown.get(k, 0.0) + v
    fsdp_forward = -(-num_microbatches // flushes) * sum(
        w * sum(x for k, x in kinds[i]["F"].items() if k not in ("ep_comm", "offload"))
        for i, w in _stages_held(pipe.busiest, dims.pp, dims.vpp, wi.dualpipe))
    after = _after_pipeline(cfg, dims, counts, profile, wi, pipe.busiest, bool(model.s["r_q"]), flushes,
                            fsdp_forward)
    breakdown.update({k: v for k, v in after.items() if k != "schedule"})
    breakdown["schedule"] += after["schedule"]
    step = pipe.makespan + sum(after.values())
    return StepTime(step_s=step, breakdown=breakdown, F=pipe.F, B=pipe.B, W=pipe.W, p2p_s=p2p, sim=pipe.sim,
                    makespan=pipe.makespan, recompute_s=breakdown["recompute"], what_if=wi.labels(),
                    ep_overlap=bool(ep_overlap and costs is not None), ep_comm=pipe.ep, busy=pipe.busy)


def _plain_pipeline(cfg, dims, kinds, wi, costs, *, m, m_sim, flushes, p2p, activation_bytes,
                    num_microbatches) -> _Pipeline:
    """megatron's (interleaved) 1F1B, every all-to-all exposed (the DualPipe what-if: its own rule)."""
    F = [sum(st["F"].values()) for st in kinds]
    B = [sum(st["B"].values()) for st in kinds]
    W = [sum(st["W"].values()) for st in kinds]
    sim = simulate(dims.pp, dims.vpp, m_sim, F, B, W, decouple_wgrad=bool(cfg.pipeline.decouple_wgrad),
                   p2p_time=p2p, activation_bytes=activation_bytes)
    held = [_stages_held(r, dims.pp, dims.vpp, wi.dualpipe) for r in range(dims.pp)]
    period = [sum(w * (F[i] + B[i] + W[i]) for i, w in held[r]) for r in range(dims.pp)]
    busiest = max(range(dims.pp), key=lambda r: period[r])
    makespan = flushes * (sim.makespan + (m - m_sim) * period[busiest])
    m = num_microbatches
    busy = m * period[busiest]
    if wi.dualpipe and dims.pp > 1:  # DualPipe's bubble (table 2): (PP/2 - 1)(F&B + B - 3W), B the full backward
        f, b, w = (sum(x * X[i] for i, x in held[busiest]) for X in (F, [p + q for p, q in zip(B, W)], W))
        makespan = busy + max(0.0, (dims.pp / 2 - 1) * (f + b + b - 3 * w))
    breakdown: dict = {}
    for i, x in held[busiest]:
        for ph in ("F", "B", "W"):
            for k, y in kinds[i][ph].items():
                _add(breakdown, k, m * x * y)
    breakdown["bubble"] = makespan - busy
    ep = None
    if costs is not None:  # every all-to-all exposed
        wire = {k: m * sum(costs.forward(i).wire[k] + costs.backward(i).wire[k] for i, _ in held[busiest])
                for k in A2A_KINDS}
        ep = ep_summary(wire, wire)
    return _Pipeline(sim, F, B, W, makespan, busiest, breakdown, ep)


def _overlap_pipeline(cfg, dims, costs, *, m, m_sim, flushes, p2p, activation_bytes,
                      pair_transient_bytes) -> _Pipeline:
    """megatron's combined 1F1B (:mod:`k2.launcher.planning.ep_overlap`): warm-up forwards and cool-down
    backwards alone, the steady pairs as one operation each; the busiest rank's terms from its steps."""
    S = dims.pp * dims.vpp
    F = [costs.forward(s).seconds for s in range(S)]
    B = [costs.backward(s).seconds for s in range(S)]
    sim = simulate(dims.pp, dims.vpp, m_sim, F, B, None, decouple_wgrad=bool(cfg.pipeline.decouple_wgrad),
                   p2p_time=p2p, activation_bytes=activation_bytes, ep_overlap=True,
                   pair_time=lambda sf, sb: costs.pair(sf, sb).seconds, pair_transient_bytes=pair_transient_bytes)
    ranks = [extrapolate(costs, rank_costs(costs, sim, r), r, dims.pp, dims.vpp, m - m_sim) for r in range(dims.pp)]
    busiest = max(range(dims.pp), key=lambda r: ranks[r]["busy"])
    rc = ranks[busiest]
    makespan = flushes * (sim.makespan + (m - m_sim) * rc["cycle"])
    breakdown = {k: flushes * v for k, v in rc["terms"].items()}
    breakdown["bubble"] = makespan - flushes * rc["busy"]
    ep = ep_summary({k: flushes * v for k, v in rc["wire"].items()},
                    {k: flushes * v for k, v in rc["exposed"].items()},
                    {k: flushes * v for k, v in rc["by_part"].items()})
    return _Pipeline(sim, F, B, [0.0] * S, makespan, busiest, breakdown, ep,
                     busy=[flushes * x["busy"] for x in ranks])


def _after_pipeline(cfg, dims, counts, profile, wi, busiest: int, q_lora: bool, flushes: int,
                    fsdp_forward_s: float) -> dict:
    """After the pipeline, on the busiest PP rank's GPU: the DP traffic (exposed; the ``fsdp`` what-if's
    rule), the optimizer and its offloaded states, the schedule's own work per step (seconds by term)."""
    precision = str(cfg.train.precision)
    world_span = dims.world_size // dims.pp
    layers, emb, loss = dims.pp_rank_contents(busiest)
    if wi.dualpipe and dims.pp > 1 and dims.vpp == 1:  # the rank keeps both its stages' parameters
        l2, e2, s2 = dims.pp_rank_contents(dims.pp - 1 - busiest)
        layers, emb, loss = sorted(set(layers) | set(l2)), emb or e2, loss or s2
    per_gpu = counts.stage(layers, emb, loss, ep=dims.ep)
    expert = sum(counts.moe_pattern[i] for i in layers) * counts.routed_experts // dims.ep
    dense = per_gpu - expert
    cross = crosses_nodes(world_span, profile)
    # bytes per parameter: ZeRO-1's FP32 gradient buffers, BF16 parameters; FSDP as AutoModel ran it: the
    # dense gradients reduced in FP32 (reduce_dtype), the experts' in their BF16 dtype (no mixed-precision
    # policy on their fully_shard), both gathered in BF16 (fsdp_exposed)
    rs = (ring_seconds(4 * dense, dims.dp, cross, profile)
          + ring_seconds((2 if wi.fsdp else 4) * expert, dims.expert_dp, cross, profile))
    ag = (ring_seconds(2 * dense, dims.dp, cross, profile) + ring_seconds(2 * expert, dims.expert_dp, cross, profile))
    if wi.fsdp:
        rs, ag = fsdp_exposed(rs, ag, flushes=flushes, layers=len(layers), forward_compute_s=fsdp_forward_s)
    nrates = profile.part_rates(profile.rates("bf16" if precision != "fp32" else "fp32"), "optimizer")
    tensors = _tensors(counts, layers, dims.ep, emb, loss, q_lora)
    opt = optimizer_time(str(cfg.optim.name), cfg.model, dims, layers, counts.moe_pattern, dense_params=dense,
                         expert_params=expert, tensors=tensors, profile=profile, rates=nrates,
                         offload_fraction=float(cfg.optim.offload_fraction), fused=precision != "fp32")
    return {"dp_grad_reduce_scatter": rs, "dp_param_all_gather": ag, "optimizer": opt.newton_schulz + opt.update,
            "muon_gather": opt.muon_gather, "optimizer_offload": opt.offload,
            "schedule": profile.step_overhead_us * 1e-6}


def _stages_held(rank: int, pp: int, vpp: int, dualpipe: bool) -> list[tuple[int, float]]:
    """The virtual stages (index ``v * pp + rank``) a PP rank runs and the share of the microbatches each
    takes: megatron's (interleaved) 1F1B, every microbatch through each of the rank's ``vpp`` stages;
    DualPipe (``vpp`` 1), stage ``rank`` for the microbatches fed from one end and stage ``pp - 1 - rank``
    for those fed from the other, half each (arXiv 2412.19437 section 3.2.1, figure 5: the shallowest
    and the deepest layers, embedding and output head, on the same rank); DualPipe has no virtual stages,
    so with ``vpp`` > 1 the interleaved order stands."""
    if dualpipe and pp > 1 and vpp == 1:
        return [(rank, 0.5), (pp - 1 - rank, 0.5)]
    return [(v * pp + rank, 1.0) for v in range(vpp)]


def _tensors(counts, layers, ep: int, emb: bool, loss: bool, q_lora: bool) -> int:
    """Parameter tensors on one GPU of a PP rank (for per-tensor optimizer launches): per layer MLA's
    projections and norms (8 with a q LoRA rank, else 6: counted on k2-train's modules), a dense MLP's 2 +
    its norm, an MoE layer's norm, router, shared expert 2 and 2 per local expert (megatron's sequential
    experts and its grouped module alike); the embedding; the output layer and the final norm."""
    n = 0
    E = getattr(counts, "num_experts", 0) or 0
    attn = 8 if q_lora else 6
    for i in layers:
        n += attn
        n += (2 + 2 + 2 * (E // ep)) if counts.moe_pattern[i] else 3
    return n + (1 if emb else 0) + (2 if loss else 0)
