"""Expert-load and aux-loss metrics of each step (K2's aux-loss-free balancing: docs/k2_reference.md "Model")."""

from __future__ import annotations

import torch

from k2.model.router import K2Router


def _routers(model: list):

    for chunk in model:
        for mod in chunk.modules():
            if isinstance(mod, K2Router):
                yield mod


def moe_step_metrics(
    model: list, num_layers: int, num_experts: int | None, num_microbatches: int, moe_layer_freq
) -> dict:
    """Expert-load and aux-loss metrics of the step just run (collective over all ranks).

    Returns:
        ``moe_load_max_over_mean``: max over MoE layers of (tokens of the busiest expert / mean tokens
        per expert), 1.0 = perfectly balanced; ``moe_routed_tokens``: token-to-expert assignments per
        MoE layer, averaged over the MoE layers (= the step's tokens x top-k when every token was routed
        exactly once, i.e. no recompute counted a forward twice); ``moe_aux_loss``: megatron's
        sequence-level aux loss averaged over MoE layers and microbatches.
    """
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    if not num_experts:
        return {}
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=dev)
    for r in _routers(model):
        counts[r.layer_number - 1] += r.step_tokens_per_expert.to(dev, torch.float64)
        r.step_tokens_per_expert.zero_()
    dist.all_reduce(counts)
    moe_rows = counts[counts.sum(dim=1) > 0]
    out = {}
    if moe_rows.numel():
        out["moe_load_max_over_mean"] = (moe_rows.max(dim=1).values / moe_rows.mean(dim=1)).max().item()
        out["moe_routed_tokens"] = moe_rows.sum(dim=1).mean().item()
    totals: dict = {}
    get_moe_metrics_tracker().report(
        loss_scale=1.0 / num_microbatches,
        iteration=0,
        force_initialize=True,
        track_names=["seq_load_balancing_loss"],
        num_layers=num_layers,
        moe_layer_freq=moe_layer_freq,
        total_loss_dict=totals,
    )
    if "seq_load_balancing_loss" in totals:
        out["moe_aux_loss"] = float(totals["seq_load_balancing_loss"])
    return out
