"""K2CoreAttention: output and per-head max logits against a plain-torch reference written here."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import per_head_max_logit


def reference_attention(q, k, v, scale):
    """softmax(scale * q k^T + causal mask) v with q,k [b, h, s, dk], v [b, h, s, dv] (plain torch)."""
    s = q.shape[2]
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * scale
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    ref_max = scores.amax(dim=(0, 2, 3))
    out = torch.einsum("bhij,bhjd->bhid", torch.softmax(scores, dim=-1), v.double())
    return out, ref_max


def make_module(heads=4, dk=48, dv=32, record=True):
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from model.attention import K2CoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, attention_dropout=0.0,
                            use_cpu_initialization=True)
    mod = K2CoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                          attention_type="self", softmax_scale=1.0 / math.sqrt(dk),
                          k_channels=dk, v_channels=dv, pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)),
                          record_max_logits=record)
    return mod


def test_output_and_max_logits_match_reference_with_mla_head_dims(megatron_world1):
    torch.manual_seed(0)
    b, h, s, dk, dv = 2, 4, 17, 48, 32  # qk head dim != v head dim, as MLA (K2: 192 / 128)
    mod = make_module(h, dk, dv)
    mod.train()
    q, k, v = torch.randn(s, b, h, dk), torch.randn(s, b, h, dk), torch.randn(s, b, h, dv)
    q[3, 1, 2] *= 20  # one head with a large logit
    out = mod(q, k, v, None)
    assert out.shape == (s, b, h * dv)
    ref, ref_max = reference_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                       v.permute(1, 2, 0, 3), 1.0 / math.sqrt(dk))
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, h * dv)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mod.max_logits.double(), ref_max, rtol=1e-5, atol=1e-5)


def test_max_logits_are_a_running_max_over_microbatches_and_reset(megatron_world1):
    torch.manual_seed(1)
    b, h, s, dk, dv = 1, 4, 8, 16, 16
    mod = make_module(h, dk, dv)
    mod.train()
    batches = [tuple(torch.randn(s, b, h, d) for d in (dk, dk, dv)) for _ in range(3)]
    expected = torch.full((h,), float("-inf"), dtype=torch.float64)
    for q, k, v in batches:
        mod(q, k, v, None)
        _, m = reference_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                   mod.softmax_scale)
        expected = torch.maximum(expected, m)
    torch.testing.assert_close(mod.max_logits.double(), expected, rtol=1e-5, atol=1e-5)
    mod.reset_max_logits()
    assert torch.isinf(mod.max_logits).all() and (mod.max_logits < 0).all()


def test_eval_forward_does_not_record(megatron_world1):
    mod = make_module()
    mod.eval()
    q = torch.randn(8, 1, 4, 48)
    mod(q, q, torch.randn(8, 1, 4, 32), None)
    assert torch.isneginf(mod.max_logits).all()


def test_causal_mask_excludes_future_positions_from_max(megatron_world1):
    mod = make_module(heads=1, dk=4, dv=4)
    mod.train()
    s = 5
    q = torch.ones(s, 1, 1, 4)
    k = torch.ones(s, 1, 1, 4)
    k[-1] *= 100.0  # only the last query may see the last key
    q[:-1] *= 1.0
    q[-1] *= 0.0  # ... and the last query has zero logits
    mod(q, k, torch.randn(s, 1, 1, 4), None)
    # max over visible pairs: queries 0..3 see keys 0..i (all logit 4 * scale); the big key is future
    assert mod.max_logits.item() == pytest.approx(4 * mod.softmax_scale, rel=1e-6)


def test_chunked_max_logit_equals_unchunked():
    torch.manual_seed(2)
    q, k = torch.randn(2, 3, 37, 8), torch.randn(2, 3, 37, 8)
    full = per_head_max_logit(q, k, 0.3, causal=True, chunk=1024)
    chunked = per_head_max_logit(q, k, 0.3, causal=True, chunk=5)
    _, ref = reference_attention(q, k, torch.zeros(2, 3, 37, 1), 0.3)
    torch.testing.assert_close(full.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked, full)
