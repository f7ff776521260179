"""Grouped-GEMM routed experts (model/grouped_mlp.py) against megatron's own SequentialMLP with
the same weights: outputs and gradients (tokens and every expert weight), experts with zero tokens, the
activation-memory switches, the decoupled weight gradient, and a short trainer run on parallel=cpu4."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

E, H, FFN = 4, 16, 8  # local experts, hidden, expert ffn (fc1 out = 2 x FFN): 16-byte rows in fp32


def _config(hidden=H, ffn=FFN):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=2,
        num_moe_experts=E,
        moe_ffn_hidden_size=ffn,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
    )


def _experts(cls, cfg=None, seed=0):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    cfg = cfg or _config()
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    mod = cls(E, cfg, sub, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return mod


def _inputs(counts, seed=1, hidden=H):
    gen = torch.Generator().manual_seed(seed)
    t = sum(counts)
    x = torch.randn(t, hidden, generator=gen)
    probs = torch.rand(t, generator=gen)
    dy = torch.randn(t, hidden, generator=gen)
    return x, torch.tensor(counts), probs, dy


def _run(mod, x, counts, probs, dy, memory=None, meter=None):
    """Forward (inside a saved-tensor scope when ``memory`` is given) and backward; returns
    ``(output, dx, dprobs, {param name: grad})``."""
    from k2.model.saved_tensors import SavedTensorScope

    mod.memory = memory
    mod.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    p = probs.clone().requires_grad_()
    if meter is not None:
        with meter.measure():
            y, _ = mod(x, counts, p)
    elif memory is not None:
        with SavedTensorScope("test"):
            y, _ = mod(x, counts, p)
    else:
        y, _ = mod(x, counts, p)
    y.backward(dy)
    return y.detach(), x.grad, p.grad, {n: q.grad.clone() for n, q in mod.named_parameters()}


def _assert_same(got, ref, rtol=1e-5, atol=1e-6):
    y, dx, dp, grads = got
    y_r, dx_r, dp_r, grads_r = ref
    torch.testing.assert_close(y, y_r, rtol=rtol, atol=atol)
    torch.testing.assert_close(dx, dx_r, rtol=rtol, atol=atol)
    torch.testing.assert_close(dp, dp_r, rtol=rtol, atol=atol)
    assert grads.keys() == grads_r.keys() and len(grads) == 2 * E
    for n in grads:
        torch.testing.assert_close(grads[n], grads_r[n], rtol=rtol, atol=atol, msg=n)


@pytest.mark.parametrize("counts", [[3, 5, 2, 6], [3, 0, 5, 0], [0, 0, 7, 0], [0, 0, 0, 0]])
def test_same_outputs_and_gradients_as_megatron_sequential_mlp(megatron_world1, counts):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from k2.model.grouped_mlp import K2GroupedMLP

    grouped, ref = _experts(K2GroupedMLP), _experts(SequentialMLP)
    ref.load_state_dict(grouped.state_dict())  # same parameter names: interchangeable checkpoints
    x, c, probs, dy = _inputs(counts)
    got, want = _run(grouped, x, c, probs, dy), _run(ref, x, c, probs, dy)
    _assert_same(got, want)
    for j, n in enumerate(counts):
        if n == 0:  # an expert without tokens gets a zero gradient, as in megatron's loop
            g = got[3][f"local_experts.{j}.linear_fc1.weight"]
            assert g is not None and torch.count_nonzero(g) == 0


def test_memory_switches_apply_as_in_the_sequential_module(megatron_world1):
    """recompute (swiglu, moe_down_proj) and offload change no number: equal to megatron's plain
    SequentialMLP; with FP8 storage too, equal to K2SequentialMLP with the same switches (same FP8 tiles:
    one scale per row-wise 1 x 128 tile), and the saved bytes per site are the same as there."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from k2.model.activation_memory import MemoryOptions
    from k2.model.grouped_mlp import K2GroupedMLP
    from k2.model.mlp import K2SequentialMLP
    from k2.model.saved_bytes_meter import SavedBytesMeter

    sites = frozenset({"moe_fc1_input", "swiglu_input"})
    no_fp8 = MemoryOptions(
        recompute=frozenset({"swiglu", "moe_down_proj"}),
        offload=frozenset({"moe_fc1_input", "swiglu_input", "fc2_input"}),
        attribute=True,
    )
    everything = MemoryOptions(
        fp8_store=sites, recompute=no_fp8.recompute, offload=frozenset({"swiglu_input"}), attribute=True
    )
    counts = [5, 0, 9, 3]
    x, c, probs, dy = _inputs(counts, seed=3)
    grouped, plain, seq = _experts(K2GroupedMLP), _experts(SequentialMLP), _experts(K2SequentialMLP)
    plain.load_state_dict(grouped.state_dict())
    seq.load_state_dict(grouped.state_dict())
    _assert_same(_run(grouped, x, c, probs, dy, no_fp8), _run(plain, x, c, probs, dy))
    m_g, m_s = SavedBytesMeter(), SavedBytesMeter()
    got = _run(grouped, x, c, probs, dy, everything, meter=m_g)
    want = _run(seq, x, c, probs, dy, everything, meter=m_s)
    _assert_same(got, want)
    b_g, b_s = m_g.per_forward(), m_s.per_forward()
    for site in ("moe_fc1_input", "swiglu_input", "fc2_input"):
        assert b_g["device"].get(site, 0) == b_s["device"].get(site, 0), site
        assert b_g["host"].get(site, 0) == b_s["host"].get(site, 0), site
    assert b_g["device"]["moe_fc1_input"] > 0 and b_g["host"]["swiglu_input"] > 0
    # FP8 changed the numbers (the switch is really on): not equal to the plain module
    assert not torch.equal(got[1], _run(plain, x, c, probs, dy)[1])


def test_decoupled_wgrad_is_deferred_and_equal(megatron_world1):
    """pipeline.decouple_wgrad: the grouped weight gradient goes into the WgradStore (nothing set before
    the drain), and after the drain every expert weight's gradient equals the undeferred one; each
    linear's DDP hook runs after its gradient is set."""
    from k2.model.grouped_mlp import K2GroupedMLP
    from k2.model.wgrad import DeferredWgrad, WgradStore, decouple_linear_wgrad

    counts = [4, 0, 6, 2]
    x, c, probs, dy = _inputs(counts, seed=5)
    ref = _run(_experts(K2GroupedMLP), x, c, probs, dy)
    mod = _experts(K2GroupedMLP)
    holder = torch.nn.Module()
    holder.decoder = torch.nn.Module()
    holder.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.decoder.layers[0].experts = mod
    store = WgradStore()
    split = decouple_linear_wgrad([holder], store)
    assert len(split) == 2 * E
    seen = []
    for lin in split:
        lin._k2_wgrad_hooks.append(lambda lin=lin: seen.append(lin.weight.grad is not None))
    xr, pr = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y, _ = mod(xr, c, pr)
    y.backward(dy)
    assert len(store) == 2 and all(isinstance(i, DeferredWgrad) for i in store.queue)  # fc2, fc1
    assert all(p.grad is None for p in mod.parameters())
    assert store.held_bytes > 0
    torch.testing.assert_close(xr.grad, ref[1])
    assert store.drain() == 2
    assert seen == [True] * (2 * E) and store.held_bytes == 0
    for n, p in mod.named_parameters():
        torch.testing.assert_close(p.grad, ref[3][n], rtol=1e-6, atol=1e-7, msg=n)


def test_unaligned_width_is_a_clear_error(megatron_world1):
    from k2.model.grouped_mlp import K2GroupedMLP

    mod = _experts(K2GroupedMLP, _config(hidden=10))
    x, c, probs, _ = _inputs([2, 1, 0, 3], hidden=10)
    with pytest.raises(ValueError, match="model.hidden_size=10"):
        mod(x, c, probs)


def test_backend_resolution(monkeypatch):
    """``auto`` is sdpa on CUDA even where Transformer Engine imports (every NGC container): TE's fused
    attention is chosen only by ``model.attention_backend=te``."""
    from k2.model import backends
    from k2.model.backends import resolve_attention_backend, resolve_grouped_experts

    monkeypatch.setattr(backends, "te_available", lambda: True)  # TE installed
    assert resolve_attention_backend("auto", cuda=False) == "eager"
    assert resolve_attention_backend("auto", cuda=True) == "sdpa"
    assert resolve_attention_backend("te", cuda=True) == "te"
    assert resolve_attention_backend("sdpa", cuda=False) == "sdpa"
    assert resolve_grouped_experts(None, "bf16", cuda=True) is True
    assert resolve_grouped_experts(None, "bf16", cuda=False) is False
    assert resolve_grouped_experts(None, "fp32", cuda=True) is False
    assert resolve_grouped_experts(True, "fp32", cuda=False) is True


def test_the_largest_tensor_of_a_grouped_layer_is_what_k2_plan_plans(megatron_world1):
    """k2-plan's transient term for grouped experts (launcher/planning/device_memory.py:
    ``stacked_expert_bytes``) is the largest tensor a forward and backward of the module make: fc1's
    stacked ``[E, 2 ffn, h]`` weights (forward, again in backward) or its weight gradient of that shape."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from k2.launcher.planning.device_memory import stacked_expert_bytes
    from k2.model.grouped_mlp import K2GroupedMLP

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and not t._is_view():
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
            return out

    mod = _experts(K2GroupedMLP)
    x, c, probs, dy = _inputs([3, 1, 2, 2])  # few tokens: activations smaller than the weights
    meter = Largest()
    with meter:
        _run(mod, x, c, probs, dy)
    assert meter.largest == stacked_expert_bytes(E, FFN, H, 4) == E * 2 * FFN * H * 4
