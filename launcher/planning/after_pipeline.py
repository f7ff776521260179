"""The step-time terms after the pipeline, on one GPU of the busiest PP rank (seconds): the DP gradient
reduce-scatter and parameter all-gather (``dp_grad_reduce_scatter``, ``dp_param_all_gather``) and the
optimizer step (``optimizer``, ``muon_gather``, ``optimizer_offload``). :func:`k2.launcher.planning.step_time.
step_time` adds them to the pipeline's makespan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from k2.launcher.planning.comm import fsdp_exposed, ring_seconds
from k2.launcher.planning.hardware import HardwareProfile
from k2.launcher.planning.optimizer_time import optimizer_time
from k2.launcher.planning.placement import block_crosses

if TYPE_CHECKING:
    from k2.config.schema import K2Config


@dataclass(frozen=True)
class RankParams:
    """The parameters on one GPU of the busiest PP rank (what the DP traffic and the optimizer move).

    Attributes:
        layers: its decoder layers (under DualPipe with vpp 1 those of both its stages).
        embedding, loss: whether it holds the word embedding / the output layer and the loss.
        dense: parameters reduced over DP (attention, dense MLPs, shared experts, router, embedding, head).
        expert: routed-expert parameters, reduced over expert-DP.
    """

    layers: list
    embedding: bool
    loss: bool
    dense: int
    expert: int


def rank_params(dims, counts, rank: int, dualpipe: bool) -> RankParams:
    """:class:`RankParams` of PP rank ``rank`` (:class:`k2.model.params.ModelParams` ``counts``)."""
    layers, embedding, loss = dims.pp_rank_contents(rank)
    if dualpipe and dims.pp > 1 and dims.vpp == 1:  # the rank keeps both its stages' parameters
        other_layers, other_embedding, other_loss = dims.pp_rank_contents(dims.pp - 1 - rank)
        layers = sorted(set(layers) | set(other_layers))
        embedding, loss = embedding or other_embedding, loss or other_loss
    per_gpu = counts.stage(layers, embedding, loss, ep=dims.ep, tp=dims.tp)
    expert = sum(counts.moe_pattern[i] for i in layers) * counts.routed_experts // dims.ep
    return RankParams(layers, embedding, loss, dense=per_gpu - expert, expert=expert)


def dp_comm_terms(
    dims, rank: RankParams, device: HardwareProfile, fsdp: bool, flushes: int, forward_s: float
) -> dict[str, float]:
    """``dp_grad_reduce_scatter`` and ``dp_param_all_gather``: the dense parameters over DP, the routed
    experts over expert-DP, exposed (``overlap_grad_reduce`` / ``overlap_param_gather`` are off in
    ``k2-train``). Bytes per parameter: ZeRO-1's FP32 gradient buffers, BF16 parameters; FSDP as AutoModel
    ran it (the ``fsdp`` what-if): the dense gradients reduced in FP32 (reduce_dtype), the experts' in their
    BF16 dtype (no mixed-precision policy on their fully_shard), both gathered in BF16, per flush
    (:func:`k2.launcher.planning.comm.fsdp_exposed`)."""
    cross = block_crosses(dims.world_size, dims.pp, device.domain_gpus)
    reduce_scatter_s = ring_seconds(4 * rank.dense, dims.dp, cross, device) + ring_seconds(
        (2 if fsdp else 4) * rank.expert, dims.expert_dp, cross, device
    )
    all_gather_s = ring_seconds(2 * rank.dense, dims.dp, cross, device) + ring_seconds(
        2 * rank.expert, dims.expert_dp, cross, device
    )
    if fsdp:
        reduce_scatter_s, all_gather_s = fsdp_exposed(
            reduce_scatter_s, all_gather_s, flushes=flushes, layers=len(rank.layers), forward_compute_s=forward_s
        )
    return {"dp_grad_reduce_scatter": reduce_scatter_s, "dp_param_all_gather": all_gather_s}


def optimizer_terms(
    cfg: K2Config, dims, counts, rank: RankParams, device: HardwareProfile, *, q_lora: bool
) -> dict[str, float]:
    """``optimizer`` (Newton-Schulz + update), ``muon_gather`` and ``optimizer_offload`` of the rank's
    parameters (:func:`k2.launcher.planning.optimizer_time.optimizer_time`)."""
    precision = str(cfg.train.precision)
    nrates = device.part_rates(device.rates("bf16" if precision != "fp32" else "fp32"), "optimizer")
    tensors = _tensors(counts, rank.layers, dims.ep, rank.embedding, rank.loss, q_lora)
    opt = optimizer_time(
        str(cfg.optim.name),
        cfg.model,
        dims,
        rank.layers,
        counts.moe_pattern,
        dense_params=rank.dense,
        expert_params=rank.expert,
        tensors=tensors,
        profile=device,
        rates=nrates,
        offload_fraction=float(cfg.optim.offload_fraction),
        fused=precision != "fp32",
    )
    return {
        "optimizer": opt.newton_schulz + opt.update,
        "muon_gather": opt.muon_gather,
        "optimizer_offload": opt.offload,
    }


def _tensors(counts, layers, ep: int, emb: bool, loss: bool, q_lora: bool) -> int:
    """Parameter tensors on one GPU of a PP rank (for per-tensor optimizer launches): per layer MLA's
    projections and norms (8 with a q LoRA rank, else 6: counted on k2-train's modules), a dense MLP's 2 +
    its norm, an MoE layer's norm, router, shared expert 2 and 2 per local expert (megatron's sequential
    experts and its grouped module alike); the embedding; the output layer and the final norm."""
    tensors = 0
    experts = getattr(counts, "num_experts", 0) or 0
    attention = 8 if q_lora else 6
    for i in layers:
        tensors += attention
        tensors += (2 + 2 + 2 * (experts // ep)) if counts.moe_pattern[i] else 3
    return tensors + (1 if emb else 0) + (2 if loss else 0)
