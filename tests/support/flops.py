"""Model FLOPs of the k2_tiny proxy counted by hand (the reference of the FLOP tests)."""

from __future__ import annotations


def tiny_forward_by_hand(m, s: int) -> dict[str, float]:
    h, H = m.hidden_size, m.num_attention_heads
    nope, rope, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    moe = m.num_layers - m.first_k_dense_replace
    return {
        "attn": m.num_layers
        * (
            2
            * (
                h * m.q_lora_rank
                + m.q_lora_rank * H * (nope + rope)
                + h * (m.kv_lora_rank + rope)
                + m.kv_lora_rank * H * (nope + v)
                + H * v * h
            )
            + H * (nope + rope + v) * s
        ),
        "dense": m.first_k_dense_replace * 6 * h * m.ffn_hidden_size,
        "moe": moe
        * (
            2 * h * m.num_moe_experts
            + m.moe_router_topk * 6 * h * m.moe_ffn_hidden_size
            + 6 * h * m.moe_shared_expert_intermediate_size
        ),
        "head": 2 * h * m.vocab_size,
    }
