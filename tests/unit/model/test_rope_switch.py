"""Switching a built K2 model from plain RoPE to YaRN in place (a schedule phase boundary,
``k2.model.rope.set_rope_type``): the rotary frequencies and the softmax scale against the YaRN formulas
written here (DeepSeek-V3 / K2 reference: ``precompute_freqs_cis`` and ``mscale = 0.1 ln(factor) + 1``),
and the switched model against one built with YaRN from the start."""

from __future__ import annotations

import math

import pytest
import torch

from k2.config.load import load_config

QK, ROPE = 32, 16  # k2_tiny: nope / rope head dims


def yarn_inv_freq(
    dim: int, base: float, factor: float, original: int, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """YaRN inverse frequencies (DeepSeek-V3 inference/model.py ``precompute_freqs_cis``)."""

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return freqs / factor * (1 - smooth) + freqs * smooth


def _build(overrides):
    from k2.model.build import build_model_chunks, layout_independent_init, transformer_config
    from k2.parallel.dims import ParallelDims

    cfg = load_config(["parallel=single", *overrides])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    tcfg = transformer_config(cfg, dims)
    chunks = build_model_chunks(cfg, dims, tcfg)
    layout_independent_init(chunks, tcfg, seed=5)
    for c in chunks:
        c.eval()
    return cfg, tcfg, chunks


def _logits(chunk, tokens):
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return chunk(tokens, pos, None)


def _mla_layers(chunk):
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    return [m for m in chunk.modules() if isinstance(m, MultiLatentAttention)]


def test_switch_to_yarn_matches_formula_and_a_yarn_built_model(megatron_world1):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    from k2.model.attention import K2CoreAttention
    from k2.model.rope import set_rope_type

    cfg, tcfg, (chunk,) = _build([])
    m = cfg.model
    tokens = torch.randint(0, m.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    rope_logits = _logits(chunk, tokens)
    layers = _mla_layers(chunk)
    assert len(layers) == m.num_layers and all(isinstance(a.rotary_pos_emb, RotaryEmbedding) for a in layers)
    assert all(a.core_attention.softmax_scale == pytest.approx(1 / math.sqrt(QK + ROPE)) for a in layers)

    assert set_rope_type([chunk], tcfg, m, "yarn") == m.num_layers
    factor = m.rotary_scaling_factor
    want_scale = (0.1 * m.mscale_all_dim * math.log(factor) + 1) ** 2 / math.sqrt(QK + ROPE)
    want_freq = yarn_inv_freq(ROPE, m.rotary_base, factor, m.original_max_position_embeddings, m.beta_fast, m.beta_slow)
    for a in layers:
        assert isinstance(a.rotary_pos_emb, YarnRotaryEmbedding)
        assert isinstance(a.core_attention, K2CoreAttention)
        assert a.softmax_scale == pytest.approx(want_scale, rel=1e-12)
        assert a.core_attention.softmax_scale == pytest.approx(want_scale, rel=1e-12)
        emb, cos_sin_scale = a.rotary_pos_emb(8)
        # position p's angles are p * inv_freq (first half; megatron repeats them)
        torch.testing.assert_close(emb[5, 0, 0, : ROPE // 2].double(), 5 * want_freq, rtol=1e-5, atol=1e-6)
        assert cos_sin_scale == pytest.approx(1.0)  # mscale / mscale_all_dim = 1 / 1
    assert tcfg.rope_type == "yarn" and tcfg.rotary_scaling_factor == factor
    assert not torch.allclose(want_freq, 1.0 / (m.rotary_base ** (torch.arange(0, ROPE, 2).double() / ROPE)))

    yarn_logits = _logits(chunk, tokens)
    assert not torch.allclose(yarn_logits, rope_logits, atol=1e-4)
    # the same weights built with YaRN from the start give the same outputs
    _, _, (fresh,) = _build(["model.rope_type=yarn"])
    fresh.load_state_dict(chunk.state_dict())
    torch.testing.assert_close(_logits(fresh, tokens), yarn_logits, rtol=1e-5, atol=1e-5)

    # and back: plain RoPE again gives the original outputs
    set_rope_type([chunk], tcfg, m, "rope")
    assert all(a.core_attention.softmax_scale == pytest.approx(1 / math.sqrt(QK + ROPE)) for a in layers)
    torch.testing.assert_close(_logits(chunk, tokens), rope_logits, rtol=1e-5, atol=1e-5)
