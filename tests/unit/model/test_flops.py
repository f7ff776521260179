"""Model FLOPs (model/flops.py): K2's figure from an independent hand count, megatron's own accounting,
MFU, and the trainer's per-step MFU (the same function)."""

from __future__ import annotations

import types
import warnings

import pytest

from k2.config.load import load_config
from k2.model.flops import flops_per_token, mfu, step_flops

K2_BATCH_TOKENS = 67_108_864


def k2_forward_by_hand(s: int) -> dict[str, float]:
    """Kimi K2's forward FLOPs per token, written from docs/k2_reference.md's numbers alone (2 FLOPs per
    multiply-add; causal attention: s/2 keys per query on average)."""
    h, heads, layers, dense, moe = 7168, 64, 61, 1, 60
    q_lora, kv_lora, nope, rope, v = 1536, 512, 128, 64, 128
    attn_proj = 2 * (
        h * q_lora
        + q_lora * heads * (nope + rope)
        + h * (kv_lora + rope)
        + kv_lora * heads * (nope + v)
        + heads * v * h
    )
    core = 2 * heads * (nope + rope) * s / 2 + 2 * heads * v * s / 2
    return {
        "mla_projections": layers * attn_proj,
        "core_attention": layers * core,
        "dense_mlp": dense * 2 * 3 * h * 18432,
        "router": moe * 2 * h * 384,
        "routed_experts": moe * 8 * 2 * 3 * h * 2048,
        "shared_experts": moe * 2 * 3 * h * 2048,
        "lm_head": 2 * h * 163840,
    }


@pytest.fixture(scope="module")
def k2():
    return load_config(["model=kimi_k2"]).model


def test_k2_flops_per_token_equal_hand_count(k2):
    f = flops_per_token(k2, 4096)
    hand = k2_forward_by_hand(4096)
    assert f.terms() == pytest.approx(hand, rel=1e-12)
    assert f.forward == pytest.approx(sum(hand.values()), rel=1e-12)
    assert f.training == pytest.approx(3 * sum(hand.values()), rel=1e-12)
    # the figures in model/flops.py's docstring
    assert round(f.forward / 1e9, 2) == 68.49 and round(f.training / 1e9, 2) == 205.47
    assert f"{step_flops(k2, 4096, K2_BATCH_TOKENS):.3e}" == "1.379e+19"
    # sanity: ~6 x active parameters (without the embedding lookup) + attention
    active_matmul_params = 32_861_477_888 - 163840 * 7168
    assert f.training == pytest.approx(6 * active_matmul_params + 3 * hand["core_attention"], rel=2e-3)
    # attention grows with the context; nothing else does
    f32k = flops_per_token(k2, 32768)
    assert f32k.forward - f.forward == pytest.approx(hand["core_attention"] * 7, rel=1e-12)


def _megatron_args(model_cfg, seq_length: int):
    m = model_cfg
    return types.SimpleNamespace(
        seq_length=seq_length,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        group_query_attention=False,
        num_query_groups=None,
        kv_channels=None,
        attention_output_gate=False,
        num_experts=m.num_moe_experts,
        moe_layer_freq=[0] * m.first_k_dense_replace + [1] * (m.num_layers - m.first_k_dense_replace),
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_latent_size=None,
        mtp_num_layers=None,
        swiglu=True,
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        padded_vocab_size=m.vocab_size,
        experimental_attention_variant=None,
        hybrid_layer_pattern=None,
    )


@pytest.mark.parametrize("model,seq", [("kimi_k2", 4096), ("kimi_k2", 32768), ("k2_tiny", 128)])
def test_agrees_with_megatron_num_floating_point_operations(model, seq):
    """megatron's own accounting (megatron.training.training.num_floating_point_operations, in the
    megatron-core wheel) counts the same terms except: no router GEMM, and 6 (q_lora + kv_lora) per layer
    and token for the latent RMSNorms. After those two, equal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.training import num_floating_point_operations

    m = load_config([f"model={model}"]).model
    batch = 3
    theirs = num_floating_point_operations(_megatron_args(m, seq), batch)
    f = flops_per_token(m, seq)
    tokens = batch * seq
    ours = f.training * tokens
    router = 3 * f.terms()["router"] * tokens
    latent_norms = 6 * (m.q_lora_rank + m.kv_lora_rank) * m.num_layers * tokens
    assert ours - router == pytest.approx(theirs - latent_norms, rel=1e-12)
    assert abs(ours - theirs) / theirs < 0.01  # the two conventions differ by < 1%


def test_mfu():
    flops = 1e15
    tflops, frac = mfu(flops, 2.0, 4, 125.0)
    assert tflops == pytest.approx(125.0) and frac == pytest.approx(1.0)
    with pytest.raises(ValueError):
        mfu(flops, 0.0, 4, 125.0)
