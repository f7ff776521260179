"""K2CoreAttention: output and per-head max logits against a plain-torch reference written here."""

from __future__ import annotations

import math

import pytest
import torch

from k2.model.attention import per_head_max_logit


def reference_attention(q, k, v, scale):
    """softmax(scale * q k^T + causal mask) v with q,k [b, h, s, dk], v [b, h, s, dv] (plain torch)."""
    s = q.shape[2]
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * scale
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    ref_max = scores.amax(dim=(0, 2, 3))
    out = torch.einsum("bhij,bhjd->bhid", torch.softmax(scores, dim=-1), v.double())
    return out, ref_max


def make_module(heads=4, dk=48, dv=32, record=True, backend="auto"):
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from k2.model.attention import K2CoreAttention

    cfg = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=heads, attention_dropout=0.0, use_cpu_initialization=True
    )
    mod = K2CoreAttention(
        cfg,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        softmax_scale=1.0 / math.sqrt(dk),
        k_channels=dk,
        v_channels=dv,
        pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)),
        record_max_logits=record,
        backend=backend,
    )
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
    ref, ref_max = reference_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), 1.0 / math.sqrt(dk)
    )
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
        _, m = reference_attention(
            q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), mod.softmax_scale
        )
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


def eager_attention(q, k, v, scale):
    """The eager reference in the compute dtype (fp32 here), written out: scores, causal mask, softmax,
    and the per-head max logit ``scale * max(q_i . k_j)`` over unmasked pairs. q, k ``[b, h, s, dk]``."""
    s = q.shape[2]
    raw = torch.matmul(q, k.transpose(-1, -2))
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    raw = raw.masked_fill(mask, float("-inf"))
    max_logit = raw.amax(dim=(0, 2, 3)) * scale
    out = torch.matmul(torch.softmax(raw * scale, dim=-1), v)
    return out, max_logit


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_backends_match_eager_reference_outputs_gradients_and_exact_max_logit(megatron_world1, backend):
    """The GPU code path (fused SDPA + separate chunked max-logit pass) run on CPU, and the eager path:
    outputs and q/k/v gradients equal an eager reference to fp32 rounding; the max logit equals it
    exactly (the same q k^T products, max before or after the positive scale is the same number)."""
    torch.manual_seed(3)
    b, h, s, dk, dv = 2, 4, 23, 48, 32  # MLA-like: qk head dim != v head dim
    mod = make_module(h, dk, dv, backend=backend)
    mod.train()
    q, k, v = (torch.randn(s, b, h, d, requires_grad=True) for d in (dk, dk, dv))
    with torch.no_grad():
        q[5, 0, 1] *= 15  # one head with a large logit
    out = mod(q, k, v, None)
    dout = torch.randn_like(out)
    out.backward(dout)
    qr, kr, vr = (t.detach().permute(1, 2, 0, 3).clone().requires_grad_() for t in (q, k, v))
    ref, ref_max = eager_attention(qr, kr, vr, mod.softmax_scale)
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, h * dv)
    ref.backward(dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for got, want in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(got.grad, want.grad.permute(2, 0, 1, 3), rtol=1e-5, atol=1e-6)
    assert torch.equal(mod.max_logits, ref_max.float())


def test_sdpa_and_eager_modules_agree(megatron_world1):
    torch.manual_seed(4)
    q, k, v = torch.randn(16, 1, 4, 48), torch.randn(16, 1, 4, 48), torch.randn(16, 1, 4, 32)
    a, e = make_module(backend="sdpa"), make_module(backend="eager")
    a.train(), e.train()
    torch.testing.assert_close(a(q, k, v, None), e(q, k, v, None), rtol=1e-5, atol=1e-6)
    assert torch.equal(a.max_logits, e.max_logits)


def test_unknown_backend_rejected(megatron_world1):
    with pytest.raises(ValueError, match="backend"):
        make_module(backend="flash")


def test_te_core_attention_adapter():
    """Transformer Engine path (only where TE is installed; skipped here -- not counted as tested)."""
    pytest.importorskip("transformer_engine")
    if not torch.cuda.is_available():
        pytest.skip("TE's fused attention needs CUDA")
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from k2.model.attention import is_max_logit_attention, te_core_attention_class

    h, dk, dv, s = 4, 64, 64, 128
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=256,
        num_attention_heads=h,
        attention_dropout=0.0,
        log_max_attention_logit=True,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    cls = te_core_attention_class()
    mod = cls(cfg, 1, AttnMaskType.causal, "self", softmax_scale=dk**-0.5, k_channels=dk, v_channels=dv)
    assert is_max_logit_attention(mod)
    q, k, v = (torch.randn(s, 1, h, d, device="cuda", dtype=torch.bfloat16) for d in (dk, dk, dv))
    mod(q, k, v, None)
    _, ref_max = reference_attention(
        q.float().permute(1, 2, 0, 3), k.float().permute(1, 2, 0, 3), v.float().permute(1, 2, 0, 3), dk**-0.5
    )
    torch.testing.assert_close(mod.max_logits.double().cpu(), ref_max.cpu(), rtol=2e-2, atol=2e-2)
    mod.reset_max_logits()
    assert torch.isneginf(mod.max_logits).all()


def test_te_adapter_records_max_logits_of_training_forwards_only():
    """The TE adapter's rule (``te_adapter`` over a stand-in with megatron's ``TEDotProductAttention``
    bookkeeping: every forward raises ``current_max_attn_logits`` to its max logit): evaluation forwards
    and whole-layer recompute re-runs leave the running max QK-Clip reads as it was, as
    ``K2CoreAttention`` does; ``record_max_logits=False`` records nothing."""
    import types

    from k2.model.attention import is_max_logit_attention, te_adapter
    from k2.model.recompute import _RERUN

    class StandIn(torch.nn.Module):  # megatron's TE attention, reduced to its max-logit bookkeeping
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
            super().__init__()
            self.current_max_attn_logits = None

        def forward(self, q, k, v, mask):
            m = q.amax(dim=(0, 1, 3))  # [np]: a stand-in for TE's max logit
            cur = self.current_max_attn_logits
            self.current_max_attn_logits = m if cur is None else torch.max(cur, m)
            return q

    cfg = types.SimpleNamespace(log_max_attention_logit=True, qk_clip=False, num_attention_heads=2)
    mod = te_adapter(StandIn)(cfg, 1, None, "self")
    assert is_max_logit_attention(mod) and torch.isneginf(mod.max_logits).all()

    def fwd(value):
        return mod(torch.full((3, 1, 2, 4), float(value)), None, None, None)

    fwd(1.0)
    assert mod.max_logits.tolist() == [1.0, 1.0]
    mod.eval()
    fwd(5.0)  # validation between two optimizer steps
    mod.train()
    assert mod.max_logits.tolist() == [1.0, 1.0]
    _RERUN.depth = 1  # a whole-layer recompute re-running the layer in backward
    try:
        fwd(7.0)
    finally:
        _RERUN.depth = 0
    assert mod.max_logits.tolist() == [1.0, 1.0]
    fwd(2.0)
    assert mod.max_logits.tolist() == [2.0, 2.0]
    mod.reset_max_logits()
    mod.record_max_logits = False
    fwd(3.0)
    assert torch.isneginf(mod.max_logits).all()


def test_the_gpu_path_never_falls_back_to_the_math_kernel(monkeypatch):
    """On CUDA the sdpa backend allows only fused kernels (torch's MATH fallback would silently
    materialise every score, far beyond the memory plan); when none takes the inputs the error names the
    setting. Seam: ``sdpa_kernel`` records the kernels it is given, and an SDPA call that finds none."""
    import contextlib

    import torch.nn.attention as attention
    from torch.nn.attention import SDPBackend

    from k2.model.attention import fused_sdpa

    given = []

    @contextlib.contextmanager
    def sdpa_kernel(backends, set_priority=False):
        given.append(list(backends))
        yield

    monkeypatch.setattr(attention, "sdpa_kernel", sdpa_kernel)
    assert fused_sdpa(lambda: "out") == "out"
    assert SDPBackend.MATH not in given[0] and given[0][0] == SDPBackend.CUDNN_ATTENTION

    def no_kernel():
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(RuntimeError, match="model.attention_backend=eager"):
        fused_sdpa(no_kernel)
