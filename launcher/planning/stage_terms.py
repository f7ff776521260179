"""The terms of each virtual stage's passes in ``k2-plan``'s step-time model (:mod:`k2.launcher.planning.step_time`
is the outline and the pipeline): seconds of one microbatch's forward (F), input gradient (B) and weight gradient
(W) per term (``gemm``, ``attention``, ``non_gemm``, ``ep_comm``, ``recompute``, ``offload``, ``schedule``,
``tp_comm``), as ``{"F": {term: s}, "B": ..., "W": ...}`` per virtual stage (index ``v * pp + rank``).

Each term is one function: the layers' kernels, all-to-alls, recompute and TP traffic (:func:`compute_terms` over
:func:`stage_model`, a layer's costs being :class:`k2.launcher.planning.stage_model.StageModel`'s), the pipeline
schedule's own work (:func:`add_schedule_work`), activation offload (:func:`add_offload`), the all-to-alls hidden
under the DualPipe what-if (:func:`hide_ep_comm_dualpipe`) or overlapped by megatron's combined 1F1B
(:func:`ep_comm_costs`), and one PP send (:func:`pp_send_seconds`). The rules of each are the step-time
module's docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k2.launcher.planning.comm import host_copy_seconds, p2p_seconds
from k2.launcher.planning.ep_overlap import OverlapCosts, stage_plans
from k2.launcher.planning.hardware import HOST_THREAD, HardwareProfile
from k2.launcher.planning.placement import pp_hop_crosses
from k2.launcher.planning.stage_model import StageModel, _add
from k2.launcher.planning.what_if import WhatIf

if TYPE_CHECKING:
    from k2.config.schema import K2Config

PASSES = ("F", "B", "W")  # forward, input gradient, weight gradient (the zero-bubble schedules' F, B, W)


def stage_model(
    cfg: K2Config, dims, fl, *, tokens: int, device: HardwareProfile, what_if: WhatIf, recompute
) -> StageModel:
    """The per-layer cost model of the phase on ``device``: the kernel rates of ``train.precision``, the
    layers' GEMMs at the FP8 rates with ``train.fp8_recipe`` (the router and the output head stay in
    ``train.precision``, as megatron's TE linears are the layers' only), under DualPipe on the SMs DeepEP
    leaves the compute (the profile's ``compute_units`` less ``deepep_comm_units``: 112 of 132 on H800),
    activations of 4 bytes (FP32) or 2, the grouped expert GEMM where ``model.moe_grouped_gemm`` says so
    (unset: with BF16)."""
    precision = str(cfg.train.precision)
    recipe = cfg.train.fp8_recipe
    compute_fraction = 1.0 - device.comm_share(deepep=True) if what_if.dualpipe else 1.0
    rates = device.rates(precision, fp8=recipe is not None, compute_fraction=compute_fraction)
    high = device.rates(precision, compute_fraction=compute_fraction)
    activation_element_bytes = 4.0 if precision == "fp32" else 2.0
    grouped = cfg.model.moe_grouped_gemm
    grouped = (precision == "bf16") if grouped is None else bool(grouped)
    return StageModel(
        cfg.model,
        fl,
        dims,
        tokens=tokens,
        profile=device,
        rates=rates,
        act_bytes=activation_element_bytes,
        grouped=grouped,
        what_if=what_if,
        recompute=recompute,
        fp8_recipe=None if recipe is None else str(recipe),
        high_rates=high,
    )


def compute_terms(model: StageModel, dims) -> list[dict]:
    """Per virtual stage (index ``v * pp + rank``) its layers' kernels, EP all-to-alls (exposed), recompute
    and TP traffic by pass and term (:class:`k2.launcher.planning.stage_model.StageModel`)."""
    same_kind: dict = {}
    return [
        _stage_totals(
            model, dims.stage_layers[r][v], dims.stage_has_loss(r, v), same_kind, dims.stage_has_embedding(r, v)
        )
        for v in range(dims.vpp)
        for r in range(dims.pp)
    ]


def _stage_totals(
    model: StageModel, layers: list[int], has_loss: bool, cache: dict, has_embedding: bool = False
) -> dict:
    """Seconds per pass and term of one microbatch on a virtual stage holding ``layers`` (+ the embedding,
    the loss).
    Layers of one kind cost the same: ``cache`` keeps one per kind."""
    tot: dict[str, dict[str, float]] = {ph: {} for ph in PASSES}
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


def add_schedule_work(stages: list[dict], device: HardwareProfile) -> float:
    """The ``schedule`` term: the pipeline schedule's own work per microbatch and virtual stage (a measured
    CPU profile's ``microbatch_overhead_us``), half before each pass; returns that half (seconds)."""
    half_s = device.microbatch_overhead_us * 1e-6 / 2
    for stage in stages:
        for ph in ("F", "B"):
            _add(stage[ph], "schedule", half_s)
    return half_s


def add_offload(stages: list[dict], offload_bytes, device: HardwareProfile, num_stages: int) -> list[float]:
    """The ``offload`` term: a stage's offloaded activations go out during its forward and come back
    during its backward on a copy stream; only what the pass's own time does not cover is exposed.
    Returns per virtual stage the seconds of one copy each way."""
    copy_s = [
        host_copy_seconds(b, device) for b in (offload_bytes if offload_bytes is not None else [0.0] * num_stages)
    ]
    for stage, t in zip(stages, copy_s):
        stage["F"]["offload"] = _hide_behind(t, sum(stage["F"].values()))
        stage["B"]["offload"] = _hide_behind(t, sum(stage["B"].values()) + sum(stage["W"].values()))
    return copy_s


def hide_ep_comm_dualpipe(stages: list[dict]) -> None:
    """The ``ep_comm`` term under the DualPipe what-if: a pass's all-to-alls hidden behind the paired
    microbatch's opposite pass (arXiv 2412.19437 section 3.2.1); what exceeds that compute is exposed."""
    for stage in stages:
        forward_compute = compute_seconds(stage["F"])
        backward_compute = compute_seconds(stage["B"]) + sum(stage["W"].values())
        stage["F"]["ep_comm"] = _hide_behind(stage["F"].get("ep_comm", 0.0), backward_compute)
        stage["B"]["ep_comm"] = _hide_behind(stage["B"].get("ep_comm", 0.0), forward_compute)


def ep_comm_costs(
    cfg: K2Config,
    model: StageModel,
    dims,
    device: HardwareProfile,
    what_if: WhatIf,
    schedule_work_half_s: float,
    copy_s: list[float],
    host_s: list[tuple[float, float]] | None = None,
) -> OverlapCosts | None:
    """The EP all-to-alls by kind and the combined 1F1B's steps (:class:`k2.launcher.planning.ep_overlap.
    OverlapCosts`, with what an all-to-all on the wire takes from the compute beside it: on a GPU the SMs of
    its kernel, NCCL's or DeepEP's, :meth:`~k2.launcher.planning.hardware.HardwareProfile.comm_share`, on
    the host's thread the profile's ``alltoall_host_cpu_share``); None without EP or experts, and under
    DualPipe (:func:`hide_ep_comm_dualpipe`). ``host_s``: per virtual stage the ``host`` term of its forward
    and backward (:func:`k2.launcher.planning.ep_overlap.stage_plans`)."""
    if dims.ep > 1 and model.s["E"] and not what_if.dualpipe:
        host = device.comm_stream == HOST_THREAD
        share = device.alltoall_host_cpu_share if host else device.comm_share(deepep=what_if.deepep)
        return OverlapCosts(
            stage_plans(model, dims, schedule_work_half_s, copy_s, host_s),
            device.comm_stream,
            bool(cfg.pipeline.decouple_wgrad),
            share,
            model.token_counts_queue_s(),
            device.alltoall_beside_compute_slowdown if host else 1.0,
        )
    return None


def pp_send_seconds(dims, activation_bytes: float, device: HardwareProfile) -> float:
    """One PP send of a microbatch's ``tokens x hidden`` activations (``activation_bytes``): consecutive PP
    ranks are world / pp ranks apart, priced across NVLink domains where some hop leaves its domain
    (:func:`k2.launcher.planning.placement.pp_hop_crosses`)."""
    return p2p_seconds(activation_bytes, pp_hop_crosses(dims.world_size, dims.pp, device.domain_gpus), device)


def _hide_behind(comm: float, compute: float) -> float:
    return max(0.0, comm - compute)


def compute_seconds(terms: dict) -> float:
    """A pass's seconds without its communication and copies (``ep_comm``, ``offload``)."""
    return sum(x for k, x in terms.items() if k not in ("ep_comm", "offload"))
