"""K2 router: sigmoid scores, expert-bias selection, normalised gates x routed scaling factor, and a
deterministic tie rule (lowest expert index wins) -- checked against a plain-Python reference."""

from __future__ import annotations

import pytest
import torch

E, K, SCALE = 8, 2, 2.827


def make_router(bias_update_rate=1e-3):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from k2.model.router import K2Router

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=bias_update_rate,
        moe_router_topk_scaling_factor=SCALE,
        moe_router_load_balancing_type="none",
        moe_router_dtype="fp32",
        use_cpu_initialization=True,
        add_bias_linear=False,
    )
    router = K2Router(config=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(2)
    return router


def reference_routing(logits: torch.Tensor, bias: torch.Tensor):
    """K2 / DeepSeek-V3 routing in plain Python: returns (chosen experts per token, gates)."""
    chosen, gates = [], []
    for row in logits.tolist():
        s = [1.0 / (1.0 + torch.exp(torch.tensor(-x, dtype=torch.float64)).item()) for x in row]
        order = sorted(range(E), key=lambda e: (-(s[e] + bias[e].item()), e))[:K]
        total = sum(s[e] for e in order)
        chosen.append(order)
        gates.append([s[e] / total * SCALE for e in order])
    return chosen, gates


def _as_lists(probs, routing_map):
    experts = [torch.nonzero(r).flatten().tolist() for r in routing_map]
    gates = [[probs[i, e].item() for e in ex] for i, ex in enumerate(experts)]
    return experts, gates


def test_all_zero_logits_pick_lowest_indices(megatron_world1):
    router = make_router()
    router.train()
    logits = torch.zeros(6, 1, E)
    probs, routing_map = router.routing(logits)
    experts, gates = _as_lists(probs, routing_map)
    assert experts == [[0, 1]] * 6
    for g in gates:  # equal sigmoid scores -> equal gates summing to the routed scaling factor
        assert g == pytest.approx([SCALE / 2, SCALE / 2], rel=1e-6)


def test_routing_matches_reference_with_bias_and_ties(megatron_world1):
    torch.manual_seed(0)
    router = make_router()
    router.train()
    logits = torch.randn(32, 1, E)
    logits[5, 0] = 0.0  # all-tie token
    logits[7, 0, 3] = logits[7, 0, 6] = 4.0  # tie between two top experts
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.1, 0.0, 0.0, -0.1, 0.0, 0.0, 0.05]))
    probs, routing_map = router.routing(logits)
    experts, gates = _as_lists(probs, routing_map)
    ref_experts, ref_gates = reference_routing(logits.view(-1, E), router.expert_bias)
    assert [sorted(r) for r in ref_experts] == experts
    for i, ex in enumerate(ref_experts):
        ref_by_e = dict(zip(ex, ref_gates[i]))
        assert gates[i] == pytest.approx([ref_by_e[e] for e in experts[i]], rel=1e-5)


def test_recompute_selects_the_same_experts(megatron_world1):
    """The forward and an activation recompute of it (megatron's checkpoint) route identically."""
    from megatron.core import tensor_parallel

    router = make_router(bias_update_rate=0.0)
    router.train()
    x = torch.zeros(16, 1, 16, requires_grad=True)  # all-zero input -> all-zero logits (ties)
    first = {}

    def fwd(inp):
        probs, routing_map = router(inp)
        first.setdefault("map", routing_map.clone())
        first["last"] = routing_map.clone()
        first["calls"] = first.get("calls", 0) + 1
        return probs

    out = tensor_parallel.checkpoint(fwd, False, x)
    out.sum().backward()  # re-runs fwd under recompute
    assert first["calls"] == 2  # the forward ran again during backward
    assert torch.equal(first["map"], first["last"])
    assert torch.nonzero(first["map"][0]).flatten().tolist() == [0, 1]


def test_step_token_counts(megatron_world1):
    router = make_router()
    router.train()
    router.step_tokens_per_expert.zero_()
    router.routing(torch.zeros(10, 1, E))
    assert router.step_tokens_per_expert.tolist() == [10, 10, 0, 0, 0, 0, 0, 0]
    with torch.no_grad():  # eval / no-grad forwards are not counted
        router.routing(torch.zeros(10, 1, E))
    assert router.step_tokens_per_expert.sum().item() == 20


def test_step_counts_stay_exact_after_bf16_cast(megatron_world1):
    """The per-step expert token counts (moe_load_max_over_mean) and megatron's counts for the expert-bias
    update are summed in fp32 after megatron's BF16 wrapper cast the buffers (model/fp32_buffers.py): in
    bf16, 257 tokens would count as 256."""
    router = make_router()
    router.bfloat16().train()
    router.step_tokens_per_expert.zero_()
    router.routing(torch.zeros(257, 1, E))  # ties: experts 0 and 1 take every token
    assert router.step_tokens_per_expert.dtype == torch.float32
    assert router.step_tokens_per_expert.tolist() == [257, 257, 0, 0, 0, 0, 0, 0]
    assert router.local_tokens_per_expert.dtype == torch.float32
    assert router.local_tokens_per_expert.tolist() == [257, 257, 0, 0, 0, 0, 0, 0]


def test_second_model_with_more_layers_in_one_process(megatron_world1):
    """megatron's router metrics tracker and aux-loss scale are process-wide; a model built after one
    with fewer MoE layers (bench=step's 3-layer models, then a 4-layer test model) must train, not index
    past the tracker's per-layer tensors (model.build.reset_moe_process_state)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from k2.config.load import load_config
    from k2.model.build import build_model_chunks, transformer_config
    from k2.parallel.dims import ParallelDims

    for layers in (2, 4):
        cfg = load_config(["model=k2_tiny", f"model.num_layers={layers}"])
        dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        model = build_model_chunks(cfg, dims, transformer_config(cfg, dims))[0]
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 32))
        loss = model(tokens, torch.arange(32).expand(2, 32), None, labels=tokens)
        loss.sum().backward()
        sizes = {len(e.values) for e in get_moe_metrics_tracker()._metrics.values()}
        assert sizes == {layers}  # the tracker was started afresh for this model
