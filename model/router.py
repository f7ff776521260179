"""K2 router: megatron's sigmoid top-k router with a deterministic tie rule.

K2 routing (docs/k2_reference.md, "Model"; DeepSeek-V3 section 2.1.2): ``s = sigmoid(x W_r^T)``; experts chosen
by top-k of ``s + b`` (``b`` the aux-loss-free expert bias); gates = chosen ``s`` normalised to sum 1,
times the routed scaling factor (2.827). megatron-core's ``TopKRouter`` implements exactly that; we only
replace *how the top-k indices are selected*: ``torch.topk`` does not define which index wins a tie (CUDA
may differ between a forward and its activation recompute, e.g. with all-zero logits at init or an
exactly balanced bias). Here ties go to the lowest expert index, via a stable descending sort.

The hook used is megatron's own top-k injection point, ``router_replay.get_replay_topk(scores, topk,
num_groups, group_topk, default_compute_topk)``, which megatron calls for every top-k selection in
``topk_routing_with_score_function``. When the user turns on megatron's routing replay, that takes
precedence and this rule is not installed. Group-limited routing (``moe_router_group_topk``; K2 uses
none) falls back to megatron's implementation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.transformer.moe.router import TopKRouter

from k2.model.fp32_buffers import fp32_buffer


def stable_topk(scores: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with ties resolved to the lowest index.

    Args:
        scores: ``[num_tokens, num_experts]``.
        topk: experts per token.

    Returns:
        ``(values, indices)``, each ``[num_tokens, topk]``, sorted by descending score, equal scores in
        ascending expert index.
    """
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :topk], indices[..., :topk]


class StableTopK:
    """Top-k selector plugged into megatron's ``router_replay`` slot (see module docstring)."""

    layer_number: int | None = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return stable_topk(scores, topk)


class K2Router(TopKRouter):
    """megatron ``TopKRouter`` whose top-k selection breaks ties to the lowest expert index.

    Also counts, per training step, the tokens routed to each expert (``step_tokens_per_expert``,
    ``[num_moe_experts]``, this rank's tokens only) for the expert-load metric; the train loop reads and
    zeroes it after each step. (megatron's own ``local_tokens_per_expert`` is consumed and zeroed by the
    expert-bias update inside ``finalize_model_grads``, before a logger could read it.)
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.router_replay is None:
            self.router_replay = StableTopK()
        self.register_buffer(
            "step_tokens_per_expert",
            torch.zeros(self.config.num_moe_experts, dtype=torch.float32),
            persistent=False,
        )

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """megatron's routing; returns ``(probs, routing_map)``, each ``[num_tokens, num_experts]``."""
        # both token counters stay fp32 under the BF16 wrapper (model/fp32_buffers.py): megatron's own one
        # feeds the expert-bias update (K2's aux-loss-free balancing), ours the expert-load metric
        if self.local_tokens_per_expert is not None:
            fp32_buffer(self, "local_tokens_per_expert")
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                counts = routing_map.sum(dim=0).to(torch.float32)
                fp32_buffer(self, "step_tokens_per_expert", counts.device).add_(counts)
        return probs, routing_map
