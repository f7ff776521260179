"""The FP8 GEMM rates of the H800 / H100 profiles, derived from DeepSeek-V3's published training profile
(launcher/planning/trace_rates.py). Pure Python: a synthetic trace, the model's kernel function."""

from __future__ import annotations

import pytest

from k2.launcher.planning import trace_rates as tr


def _kernel(name, ts, dur, corr):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _trace():
    """One layer's worth of kernels: a dense forward GEMM, a grouped expert GEMM, the 10 weight-gradient
    GEMMs of mlp(W) (the 2nd and 3rd overlapping by 50 us), a BF16 cuBLAS GEMM and a DeepGEMM transpose."""
    gg = "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::{}::GemmKernel>(x)"
    ev = [
        {"cat": "user_annotation", "name": "attn(F)", "ts": 0, "dur": 100},
        {"cat": "user_annotation", "name": "mlp(F)", "ts": 100, "dur": 100},
        {"cat": "user_annotation", "name": "mlp(W)", "ts": 200, "dur": 100},
    ]
    ks = [
        (gg.format("fp8_ptp128c"), 1000, 300, 10),
        (gg.format("m_grouped_fp8_ptp128c"), 2000, 700, 110),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n", 3000, 40, 20),
        ("void dpsk::grouped_gemm::cuda::utils::transpose<512>(x)", 3100, 10, 120),
    ]
    t = 4000
    for i in range(10):  # shared expert's first and last, the experts' 8 between
        ks.append((gg.format("fp8_dptp128c_acc"), t, 100, 210 + i))
        t += 50 if i == 1 else 100  # the 3rd starts while the 2nd runs: 50 us of overlap
    for name, ts, dur, corr in ks:
        ev.append(_kernel(name, ts, dur, corr))
        ev.append(
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": corr, "dur": 1, "args": {"correlation": corr}}
        )
    return {"traceEvents": ev}


def test_trace_gemm_seconds_splits_dense_and_expert_and_shares_overlaps():
    """Dense: the forward GEMM and mlp(W)'s first and last; expert: the grouped GEMM and mlp(W)'s other 8,
    two of which overlap (the overlap counted once); BF16 cuBLAS and transposes left out."""
    got = tr.trace_gemm_seconds(_trace())
    assert got["dense"] == pytest.approx((300 + 2 * 100) * 1e-6)
    assert got["expert"] == pytest.approx((700 + 8 * 100 - 50) * 1e-6)


@pytest.fixture(scope="module")
def v3():
    from k2.config import load_config

    return load_config(["model=deepseek_v3"]).model


def _trace_flops(m) -> dict:
    """FLOPs of the trace's FP8 GEMMs, counted by hand: 4 layers, F + B + W (3 x 2 T k n), MLA's
    up-projections once more (recomputed); the experts see T x top-k tokens in all."""
    T, h, H = tr.TRACE_TOKENS, m.hidden_size, m.num_attention_heads
    qk, r, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    up = m.q_lora_rank * H * (qk + r) + m.kv_lora_rank * H * (qk + v)
    dense = (
        h * m.q_lora_rank + h * (m.kv_lora_rank + r) + H * v * h + up + 3 * h * m.moe_shared_expert_intermediate_size
    )
    expert = m.moe_router_topk * 3 * h * m.moe_ffn_hidden_size
    return {"dense": 4 * 2 * T * (3 * dense + up), "expert": 4 * 3 * 2 * T * expert}


def test_derived_rates_reproduce_the_trace_and_sit_just_above_its_flop_rate(v3):
    """The derived rates give the trace's seconds through the model's kernel function; they are at least
    the trace's FLOPs over its seconds scaled to 132 SMs (tile / wave quantization and launches only add
    time) and within 10% of it."""
    from k2.launcher.planning.hardware import load_profile

    p = load_profile("h800")
    rates = tr.derive_fp8_rates(v3, p)
    got = tr.chunk_gemm_seconds(v3, p, rates["gemm_fp8_tflops"], rates["gemm_grouped_fp8_tflops"])
    assert got == pytest.approx(tr.TRACE_GEMM_S, rel=1e-6)
    flops = _trace_flops(v3)
    for cls, key in (("dense", "gemm_fp8_tflops"), ("expert", "gemm_grouped_fp8_tflops")):
        measured = flops[cls] / tr.TRACE_GEMM_S[cls] / 1e12 * 132 / 112
        assert measured <= rates[key] < 1.1 * measured, (cls, measured, rates[key])


def test_h800_and_h100_profiles_carry_the_derived_rates(v3):
    """The Hopper profiles' FP8 rates are the trace's (rounded to 1 TFLOP/s), not DeepGEMM's 1550 / 1260
    (H800, H100 and H200: the same SMs and clocks)."""
    from k2.launcher.planning.hardware import load_profile

    for name in ("h800", "h100", "h200"):
        p = load_profile(name)
        rates = tr.derive_fp8_rates(v3, p)
        assert p.gemm_fp8_tflops == round(rates["gemm_fp8_tflops"])
        assert p.gemm_grouped_fp8_tflops == round(rates["gemm_grouped_fp8_tflops"])


def test_no_rate_gives_an_impossible_time(v3):
    from k2.launcher.planning.hardware import load_profile

    with pytest.raises(ValueError, match="gemm_fp8_tflops"):
        tr.derive_fp8_rates(v3, load_profile("h800"), {"dense": 1e-9, "expert": 1.0})
