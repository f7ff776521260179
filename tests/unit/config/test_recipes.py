"""Every number of docs/k2_reference.md's "Model" table is in recipes/model/kimi_k2.yaml and reaches megatron's
MLATransformerConfig unchanged; k2_tiny is the same family. The expected values are typed in from the
K2 report / model card, not read from the code under test."""

from __future__ import annotations

import math

import pytest

from k2.config.load import load_config

K2 = {
    "num_layers": 61,
    "first_k_dense_replace": 1,
    "hidden_size": 7168,
    "ffn_hidden_size": 18432,
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "num_moe_experts": 384,
    "moe_router_topk": 8,
    "moe_ffn_hidden_size": 2048,
    "moe_shared_expert_intermediate_size": 2048,
    "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "moe_router_topk_scaling_factor": 2.827,
    "moe_router_num_groups": None,
    "moe_router_load_balancing_type": "seq_aux_loss",
    "vocab_size": 163840,
    "rotary_base": 50000,
    "rotary_scaling_factor": 32,
    "original_max_position_embeddings": 4096,
    "max_position_embeddings": 131072,
    "normalization": "RMSNorm",
    "share_embeddings_and_output_weights": False,
}


def test_kimi_k2_recipe_holds_every_reference_number():
    m = load_config(["model=kimi_k2"]).model
    for key, want in K2.items():
        assert m[key] == want, key
    assert m.num_moe_experts / m.moe_router_topk == 48  # sparsity
    assert m.original_max_position_embeddings * m.rotary_scaling_factor == 131072


def _tcfg(overrides, world):
    from k2.model.build import transformer_config
    from k2.parallel.dims import ParallelDims

    cfg = load_config(overrides)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world)
    return cfg, transformer_config(cfg, dims)


def test_kimi_k2_reaches_megatron_config():
    cfg, t = _tcfg(["model=kimi_k2", "parallel=k2_256gpu", "train.precision=bf16"], 256)
    assert (t.num_layers, t.hidden_size, t.num_attention_heads) == (61, 7168, 64)
    assert (t.q_lora_rank, t.kv_lora_rank, t.qk_head_dim, t.qk_pos_emb_head_dim, t.v_head_dim) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert t.qk_layernorm  # RMSNorm on the q / kv latents
    assert (t.num_moe_experts, t.moe_router_topk, t.moe_ffn_hidden_size) == (384, 8, 2048)
    assert t.moe_layer_freq == [0] + [1] * 60
    assert t.moe_router_topk_scaling_factor == pytest.approx(2.827)
    assert t.gated_linear_unit and t.normalization == "RMSNorm" and not t.add_bias_linear
    assert (t.pipeline_model_parallel_size, t.virtual_pipeline_model_parallel_size, t.expert_model_parallel_size) == (
        16,
        2,
        16,
    )
    assert t.bf16


def test_softmax_scale_plain_rope_vs_yarn():
    """Pretraining at 4K uses plain RoPE: softmax scale 1/sqrt(qk 192). With YaRN (factor 32,
    mscale_all_dim 1) the scale is (0.1 ln 32 + 1)^2 / sqrt(192) (DeepSeek-V3 / K2 YaRN)."""
    from megatron.core.transformer.multi_latent_attention import _yarn_get_mscale

    _, rope = _tcfg(["model=kimi_k2", "parallel=k2_256gpu"], 256)
    _, yarn = _tcfg(["model=kimi_k2", "parallel=k2_256gpu", "model.rope_type=yarn"], 256)
    m_rope = _yarn_get_mscale(rope.rotary_scaling_factor, rope.mscale_all_dim)
    m_yarn = _yarn_get_mscale(yarn.rotary_scaling_factor, yarn.mscale_all_dim)
    assert m_rope == 1.0
    assert m_yarn == pytest.approx(0.1 * math.log(32) + 1.0)
    assert yarn.rope_type == "yarn" and yarn.rotary_scaling_factor == 32


def test_k2_tiny_is_the_same_family():
    m = load_config([]).model
    assert m.name == "k2_tiny" and m.first_k_dense_replace == 1 and 8 <= m.num_moe_experts <= 16
    for key in (
        "moe_router_score_function",
        "moe_router_enable_expert_bias",
        "moe_router_topk_scaling_factor",
        "moe_router_load_balancing_type",
        "normalization",
        "rotary_base",
        "share_embeddings_and_output_weights",
    ):
        assert m[key] == K2[key], key
    assert m.moe_shared_expert_intermediate_size == m.moe_ffn_hidden_size  # one shared expert


def test_kimi_k2_selects_k2_training_and_memory_settings():
    """model=kimi_k2 picks K2's training recipe (BF16, one sequence per microbatch) and memory=k2, as it
    picks its schedule and optimizer; the command line still wins. Expected values typed in from
    docs/k2_reference.md "Training system", not read from the recipes."""
    cfg = load_config(["model=kimi_k2"])
    assert (cfg.train.precision, cfg.train.micro_batch_size, cfg.train.iters) == ("bf16", 1, None)
    assert sorted(cfg.memory.fp8_store) == ["moe_fc1_input", "swiglu_input"]
    assert sorted(cfg.memory.recompute) == ["layernorm", "mla_up_proj", "moe_down_proj", "swiglu"]
    assert "attn_input" in cfg.memory.offload
    # cadence for K2's 237,823 steps: hundreds of validation points and checkpoints, not one per step
    steps = 237_823
    assert 100 <= steps // cfg.train.eval_interval <= 1000
    assert 100 <= steps // cfg.train.save_interval <= 2000
    over = load_config(["model=kimi_k2", "train=tiny", "memory=none", "train.micro_batch_size=2"])
    assert (over.train.precision, over.train.micro_batch_size, list(over.memory.recompute)) == ("fp32", 2, [])
    tiny = load_config([])  # k2_tiny keeps the CPU proxy's
    assert (tiny.train.precision, tiny.train.micro_batch_size, list(tiny.memory.offload)) == ("fp32", 2, [])
