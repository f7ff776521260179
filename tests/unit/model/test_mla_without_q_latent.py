"""MLA without a query latent (``model.q_lora_rank: null``: Moonlight-16B-A3B, DeepSeek-V2-Lite) builds on
megatron's local layer spec, without Transformer Engine, with the Hugging Face models' structure: the query
projection reads the layer's normalised input directly (no norm of its own), the KV latent keeps its norm."""

from __future__ import annotations

import torch

from k2.config import load_config


def _build():
    from k2.model.build import build_model_chunks, layout_independent_init, transformer_config
    from k2.parallel.dims import ParallelDims

    cfg = load_config(["parallel=single", "model.q_lora_rank=null"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    tcfg = transformer_config(cfg, dims)
    chunks = build_model_chunks(cfg, dims, tcfg)
    layout_independent_init(chunks, tcfg, seed=5)
    return cfg, chunks[0]


def test_query_projection_reads_the_layer_input_without_a_norm(megatron_world1):
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    cfg, chunk = _build()
    attn = next(m for m in chunk.modules() if isinstance(m, MultiLatentAttention))
    m = cfg.model
    # HF's q_proj [H (d_qk + d_r), h]: one plain weight, no norm weight beside it
    q_params = dict(attn.linear_q_proj.named_parameters())
    assert list(q_params) == ["weight"]
    assert tuple(q_params["weight"].shape) == (
        m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim),
        m.hidden_size,
    )
    assert not hasattr(attn, "linear_q_down_proj")
    assert not hasattr(attn, "q_layernorm") or isinstance(attn.q_layernorm, IdentityOp)
    # the KV latent's RMSNorm is built (kv_a_layernorm of the HF model)
    assert not isinstance(attn.kv_layernorm, IdentityOp)
    assert tuple(attn.kv_layernorm.weight.shape) == (m.kv_lora_rank,)

    seen = {}

    def keep(name):
        def hook(mod, args, kwargs):
            seen.setdefault(name, args[0] if args else kwargs["hidden_states"])

        return hook

    attn.register_forward_pre_hook(keep("attn"), with_kwargs=True)
    attn.linear_q_proj.register_forward_pre_hook(keep("q"), with_kwargs=True)
    tokens = torch.randint(0, m.vocab_size, (1, 16))
    pos = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        logits = chunk(tokens, pos, None)
    assert torch.isfinite(logits).all()
    # the query projection's input is the attention's input (the layer's input norm's output), unchanged
    assert torch.equal(seen["q"], seen["attn"])
