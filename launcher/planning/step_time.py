"""``k2-plan``'s step time from a performance model: kernels, communication, recompute, offload, the
optimizer and the pipeline bubble, per term, on a hardware profile (:mod:`k2.launcher.planning.hardware`).

Per virtual stage and microbatch of ``T = micro_batch_size x seq_length`` tokens (one GPU, TP = 1; a layer's
costs: :mod:`k2.launcher.planning.stage_model`):

* **GEMMs** at their shapes (:mod:`k2.launcher.planning.kernels`: roofline, tile and wave quantization, a launch cost
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
  section 3.2.1), with the profile's ``deepep_comm_units`` SMs given to communication (DeepSeek-V3: 20
  of 132, section 3.2.2) so compute runs at the rest of ``compute_units``' share of its rates.
* **Recompute** (``memory.recompute``): the sites' forward work again in the backward (``layer``: the whole
  forward, its all-to-alls included).
* **Activation offload** (``memory.offload``): the stage's offloaded bytes go out during the forward and
  back during the backward on a copy stream (its own engine and PCIe path); only what exceeds the pass's
  time (compute and all-to-alls) is exposed.
* **The host** (``host``): where the CPU issuing the operators takes longer than the GPU runs them between
  two of the MoE dispatcher's waits for the host (:mod:`k2.launcher.planning.host_bound`).
* **The pipeline schedule's own work** (``schedule``): a measured CPU profile's cost of megatron's schedule and the
  trainer's step functions beyond the model's operators, per microbatch and virtual stage and per step.
* **PP sends**: ``T x h`` activations per stage boundary, across nodes when PP ranks are on different nodes,
  as the simulator's ``p2p_time``.

The pipeline: megatron's (interleaved) 1F1B order simulated with these per-stage times
(:func:`k2.launcher.planning.pipeline_sim.simulate`; with the EP overlap its combined order, a steady pair one
operation); the **bubble** is the busiest PP rank's idle time in it
(with the DualPipe what-if, PP rank r runs stage r and stage PP - 1 - r, half the microbatches each, and
DualPipe's bubble ``(PP/2 - 1)(F&B + B - 3W)``, arXiv 2412.19437 table 2).
After the pipeline: the **DP gradient reduce-scatter** (FP32, megatron's ZeRO-1 buffers) and **parameter
all-gather** (BF16), exposed (``overlap_grad_reduce`` / ``overlap_param_gather`` are off in ``k2-train``;
the ``fsdp`` what-if: per pipeline flush, :func:`k2.launcher.planning.comm.fsdp_exposed`), and the
**optimizer step** (:mod:`k2.launcher.planning.optimizer_time`); both in :mod:`k2.launcher.planning.after_pipeline`.

:func:`step_time` is the outline; each term is one function of its own (the stage's terms in
:mod:`k2.launcher.planning.stage_terms`: :func:`~k2.launcher.planning.stage_terms.compute_terms`,
:func:`~k2.launcher.planning.stage_terms.add_schedule_work`, :func:`~k2.launcher.planning.stage_terms.add_offload`,
:func:`~k2.launcher.planning.stage_terms.hide_ep_comm_dualpipe`,
:func:`~k2.launcher.planning.stage_terms.ep_comm_costs`, :func:`~k2.launcher.planning.stage_terms.pp_send_seconds`;
the pipeline and its bubble here; then :func:`~k2.launcher.planning.after_pipeline.dp_comm_terms` and
:func:`~k2.launcher.planning.after_pipeline.optimizer_terms`).

GEMM precision: ``train.fp8_recipe`` (``blockwise`` | ``mxfp8``, k2-train's setting for Transformer Engine)
runs the layers' GEMMs at the profile's FP8 rates, each FP8 GEMM's input and output gradient quantised
first (term ``quantize``: :meth:`k2.launcher.planning.stage_model.StageModel.quantize_s`); the router and
the output head stay in ``train.precision``.

What-if settings (``plan.what_if.*``), for comparing with published runs only (``k2-train`` has none of
them; :mod:`k2.launcher.planning.what_if`): ``fsdp`` (FSDP2 under
torch's pipelining: :func:`k2.launcher.planning.comm.fsdp_exposed`), ``dualpipe``,
``deepep`` (megatron's ``flex`` dispatcher: DeepEP's rates and SMs, FP8 dispatch with an FP8 recipe, a
token crosses to each remote node once: NVLink forwarding),
``node_limit`` (DeepSeek-V3's routing to at most M nodes), ``pipeline_flushes`` (gradient accumulation over
that many pipeline schedules, each with its own fill and drain), ``mtp_layers`` (multi-token-prediction
modules on the stage holding the loss: :meth:`StageModel.mtp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from k2.launcher.planning.after_pipeline import dp_comm_terms, optimizer_terms, rank_params
from k2.launcher.planning.ep_overlap import A2A_KINDS, ep_summary, extrapolate, overlap_applies, rank_costs
from k2.launcher.planning.hardware import HardwareProfile
from k2.launcher.planning.host_bound import HOST_TERM, add_host_term
from k2.launcher.planning.pipeline_sim import simulate
from k2.launcher.planning.stage_model import _add
from k2.launcher.planning.stage_terms import (
    PASSES,
    add_offload,
    add_schedule_work,
    compute_seconds,
    compute_terms,
    ep_comm_costs,
    hide_ep_comm_dualpipe,
    pp_send_seconds,
    stage_model,
)
from k2.launcher.planning.what_if import WhatIf

if TYPE_CHECKING:
    from k2.config.schema import K2Config

TERMS = ("gemm", "attention", "non_gemm", "ep_comm", "recompute", "offload", "schedule", HOST_TERM)


@dataclass
class StepTime:
    """One step's time and its breakdown on the busiest PP rank (seconds).

    Attributes:
        step_s: the step's seconds.
        breakdown: seconds per term: compute by kind (``gemm``, ``attention``, ``non_gemm``), exposed
            communication by kind (``ep_comm``, ``pp_p2p`` within ``bubble``, ``dp_grad_reduce_scatter``,
            ``dp_param_all_gather``, ``muon_gather``), ``recompute``, ``offload`` (exposed host copies of
            activations), ``bubble`` (idle time of the busiest PP rank in the simulated schedule, its waits
            for PP sends included), ``optimizer`` (Newton-Schulz + update), ``optimizer_offload`` and
            ``schedule`` (the pipeline schedule's and the step functions' own CPU work). They sum to
            ``step_s``.
        F, B, W: per virtual stage the seconds of one microbatch's forward / input gradient / weight
            gradient (what the simulator ran).
        p2p_s: one PP send.
        sim: the simulated pipeline (:class:`k2.launcher.planning.pipeline_sim.PipelineResult`).
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


@dataclass(frozen=True)
class Microbatches:
    """How one DP rank's microbatches of a step go through the pipeline.

    Attributes:
        flushes: pipeline flushes per step (the ``pipeline_flushes`` what-if; 1 in ``k2-train``), each with
            its own fill and drain and at least pp microbatches.
        per_flush: microbatches per flush (rounded up).
        simulated: microbatches per flush the simulator runs (a multiple of pp under ``max_microbatches``);
            the rest are extrapolated at the busiest rank's per-microbatch time.
    """

    flushes: int
    per_flush: int
    simulated: int


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


def step_time(
    cfg: K2Config,
    dims,
    counts,
    fl,
    *,
    tokens: int,
    num_microbatches: int,
    recompute=(),
    offload_bytes=None,
    activation_bytes=None,
    profile: HardwareProfile,
    max_microbatches: int | None = None,
    ep_overlap: bool | None = None,
    pair_transient_bytes=None,
) -> StepTime:
    """The step time of one phase on one layout, with its breakdown (module docstring): each term is one
    function below, the pipeline's bubble from the simulator.

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
            microbatches (its largest layer's; :func:`k2.launcher.planning.pipeline_sim.simulate`).

    Returns:
        :class:`StepTime`.
    """
    what_if = WhatIf.from_config(cfg)
    device = profile
    model = stage_model(cfg, dims, fl, tokens=tokens, device=device, what_if=what_if, recompute=recompute)
    stages = compute_terms(model, dims)
    add_host_term(stages, model, cfg.model, dims, device, what_if.cuda_graphs)
    schedule_work_half_s = add_schedule_work(stages, device)
    copy_s = add_offload(stages, offload_bytes, device, dims.pp * dims.vpp)
    if what_if.dualpipe:
        hide_ep_comm_dualpipe(stages)
    host_s = [(s["F"].get(HOST_TERM, 0.0), s["B"].get(HOST_TERM, 0.0)) for s in stages]
    ep_costs = ep_comm_costs(cfg, model, dims, device, what_if, schedule_work_half_s, copy_s, host_s)
    pp_send_s = pp_send_seconds(dims, tokens * model.s["h"] * model.a, device)
    micro = microbatch_split(num_microbatches, dims.pp, what_if.pipeline_flushes, max_microbatches)
    if ep_overlap is None:
        ep_overlap = overlap_applies(cfg, dims, recompute, what_if)[0]
    sim_args = dict(micro=micro, p2p=pp_send_s if dims.pp > 1 else 0.0, activation_bytes=activation_bytes)
    if ep_overlap and ep_costs is not None:
        pipe = _overlap_pipeline(cfg, dims, ep_costs, pair_transient_bytes=pair_transient_bytes, **sim_args)
    else:
        pipe = _plain_pipeline(cfg, dims, stages, what_if, ep_costs, num_microbatches=num_microbatches, **sim_args)
    after = _after_pipeline(cfg, dims, counts, stages, pipe, micro, device, what_if, q_lora=bool(model.s["r_q"]))
    breakdown = _breakdown(pipe.breakdown, after, dims.tp)
    step = pipe.makespan + sum(after.values())
    return StepTime(
        step_s=step,
        breakdown=breakdown,
        F=pipe.F,
        B=pipe.B,
        W=pipe.W,
        p2p_s=pp_send_s,
        sim=pipe.sim,
        makespan=pipe.makespan,
        recompute_s=breakdown["recompute"],
        what_if=what_if.labels(),
        ep_overlap=bool(ep_overlap and ep_costs is not None),
        ep_comm=pipe.ep,
        busy=pipe.busy,
    )


def _after_pipeline(
    cfg: K2Config,
    dims,
    counts,
    stages: list[dict],
    pipe: _Pipeline,
    micro: Microbatches,
    device: HardwareProfile,
    what_if: WhatIf,
    *,
    q_lora: bool,
) -> dict[str, float]:
    """Seconds per step of the terms after the pipeline, for the busiest PP rank's parameters: the DP traffic
    (:func:`~k2.launcher.planning.after_pipeline.dp_comm_terms`), the optimizer step
    (:func:`~k2.launcher.planning.after_pipeline.optimizer_terms`) and the step's own ``schedule`` work."""
    rank = rank_params(dims, counts, pipe.busiest, what_if.dualpipe)
    forward_s = fsdp_forward_seconds(stages, dims, pipe.busiest, what_if.dualpipe, micro.per_flush)
    return {
        **dp_comm_terms(dims, rank, device, what_if.fsdp, micro.flushes, forward_s),
        **optimizer_terms(cfg, dims, counts, rank, device, q_lora=q_lora),
        "schedule": device.step_overhead_us * 1e-6,
    }


def _breakdown(pipeline_terms: dict, after: dict[str, float], tp: int) -> dict[str, float]:
    """The step's seconds per term (:attr:`StepTime.breakdown`): every one of :data:`TERMS` (and ``tp_comm``
    with TP), the pipeline's terms, then the terms after it, ``schedule`` added to the pipeline's."""
    breakdown = {k: 0.0 for k in TERMS + (("tp_comm",) if tp > 1 else ())}
    for k, v in pipeline_terms.items():
        breakdown[k] = breakdown.get(k, 0.0) + v
    breakdown.update({k: v for k, v in after.items() if k != "schedule"})
    breakdown["schedule"] += after["schedule"]
    return breakdown


# ---- the pipeline: the bubble (and every per-stage term over the step's microbatches)


def microbatch_split(
    num_microbatches: int, pp: int, pipeline_flushes: int, max_microbatches: int | None
) -> Microbatches:
    """:class:`Microbatches` of a step of ``num_microbatches`` per DP rank."""
    flushes = max(1, min(pipeline_flushes, num_microbatches // pp))
    per_flush = -(-num_microbatches // flushes)
    simulated = (
        per_flush if max_microbatches is None or per_flush <= max_microbatches else max(pp, max_microbatches // pp * pp)
    )
    return Microbatches(flushes, per_flush, simulated)


def _plain_pipeline(
    cfg: K2Config, dims, stages, what_if, ep_costs, *, micro: Microbatches, p2p, activation_bytes, num_microbatches
) -> _Pipeline:
    """megatron's (interleaved) 1F1B, every all-to-all exposed (the DualPipe what-if: its own rule)."""
    F = [sum(st["F"].values()) for st in stages]
    B = [sum(st["B"].values()) for st in stages]
    W = [sum(st["W"].values()) for st in stages]
    sim = simulate(
        dims.pp,
        dims.vpp,
        micro.simulated,
        F,
        B,
        W,
        decouple_wgrad=bool(cfg.pipeline.decouple_wgrad),
        p2p_time=p2p,
        activation_bytes=activation_bytes,
    )
    held = [_stages_held(r, dims.pp, dims.vpp, what_if.dualpipe) for r in range(dims.pp)]
    period = [sum(w * (F[i] + B[i] + W[i]) for i, w in held[r]) for r in range(dims.pp)]
    busiest = max(range(dims.pp), key=lambda r: period[r])
    makespan = micro.flushes * (sim.makespan + (micro.per_flush - micro.simulated) * period[busiest])
    busy = num_microbatches * period[busiest]
    if what_if.dualpipe and dims.pp > 1:  # DualPipe's bubble (table 2): (PP/2 - 1)(F&B + B - 3W), B the full backward
        f, b, w = (sum(x * X[i] for i, x in held[busiest]) for X in (F, [p + q for p, q in zip(B, W)], W))
        makespan = busy + max(0.0, (dims.pp / 2 - 1) * (f + b + b - 3 * w))
    breakdown: dict = {}
    for i, x in held[busiest]:
        for ph in PASSES:
            for k, y in stages[i][ph].items():
                _add(breakdown, k, num_microbatches * x * y)
    breakdown["bubble"] = makespan - busy
    ep = None
    if ep_costs is not None:  # every all-to-all exposed
        wire = {
            k: num_microbatches
            * sum(ep_costs.forward(i).wire[k] + ep_costs.backward(i).wire[k] for i, _ in held[busiest])
            for k in A2A_KINDS
        }
        ep = ep_summary(wire, wire)
    return _Pipeline(sim, F, B, W, makespan, busiest, breakdown, ep)


def _overlap_pipeline(
    cfg: K2Config, dims, ep_costs, *, micro: Microbatches, p2p, activation_bytes, pair_transient_bytes
) -> _Pipeline:
    """megatron's combined 1F1B (:mod:`k2.launcher.planning.ep_overlap`): warm-up forwards and cool-down
    backwards alone, the steady pairs as one operation each; the busiest rank's terms from its steps."""
    num_stages = dims.pp * dims.vpp
    F = [ep_costs.forward(s).seconds for s in range(num_stages)]
    B = [ep_costs.backward(s).seconds for s in range(num_stages)]
    sim = simulate(
        dims.pp,
        dims.vpp,
        micro.simulated,
        F,
        B,
        None,
        decouple_wgrad=bool(cfg.pipeline.decouple_wgrad),
        p2p_time=p2p,
        activation_bytes=activation_bytes,
        ep_overlap=True,
        pair_time=lambda sf, sb: ep_costs.pair(sf, sb).seconds,
        pair_transient_bytes=pair_transient_bytes,
    )
    unsimulated = micro.per_flush - micro.simulated
    ranks = [
        extrapolate(ep_costs, rank_costs(ep_costs, sim, r), r, dims.pp, dims.vpp, unsimulated) for r in range(dims.pp)
    ]
    busiest = max(range(dims.pp), key=lambda r: ranks[r]["busy"])
    busiest_cost = ranks[busiest]
    flushes = micro.flushes
    makespan = flushes * (sim.makespan + unsimulated * busiest_cost["cycle"])
    breakdown = {k: flushes * v for k, v in busiest_cost["terms"].items()}
    breakdown["bubble"] = makespan - flushes * busiest_cost["busy"]
    ep = ep_summary(
        {k: flushes * v for k, v in busiest_cost["wire"].items()},
        {k: flushes * v for k, v in busiest_cost["exposed"].items()},
        {k: flushes * v for k, v in busiest_cost["by_part"].items()},
    )
    return _Pipeline(
        sim, F, B, [0.0] * num_stages, makespan, busiest, breakdown, ep, busy=[flushes * x["busy"] for x in ranks]
    )


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


def fsdp_forward_seconds(stages: list[dict], dims, rank: int, dualpipe: bool, per_flush: int) -> float:
    """The forward compute of PP rank ``rank`` per pipeline flush (what the ``fsdp`` what-if's all-gathers
    hide behind: :func:`k2.launcher.planning.comm.fsdp_exposed`)."""
    return per_flush * sum(
        w * compute_seconds(stages[i]["F"]) for i, w in _stages_held(rank, dims.pp, dims.vpp, dualpipe)
    )
