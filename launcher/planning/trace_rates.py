"""Hopper's FP8 GEMM rates as DeepSeek-V3's published training profile measured them.

Source: github.com/deepseek-ai/profile-data ``train.json`` (PyTorch profiler trace of one DualPipe pair of
a forward and a backward chunk of 4 MoE layers of DeepSeek-V3 on H800: EP64, TP1, one 4,096-token sequence
per microbatch, balanced routing; the GEMM kernels run on 112 of the 132 SMs, grid 112, the other 20 run
DeepEP). H800 and H100 SXM5 have the same SMs and clocks, so the figures stand for both.

The trace's GEMM kernels (``dpsk::grouped_gemm::cuda::*``, FP8 with per-128 scaling):

* dense: ``fp8_ptp128c`` (MLA's projections and the shared expert, forward and input gradient, and MLA's
  up-projections recomputed in the backward), ``fp8_dptp128c_acc`` in the ``attn(W)`` range (MLA's weight
  gradients) and the first and last of the 10 ``fp8_dptp128c_acc`` per layer in the ``mlp(W)`` range (the
  shared expert's two weight gradients, on the compute stream alone): **30.60 ms**;
* expert: ``m_grouped_fp8_ptp128c`` (the 4 local experts' forward and input gradient, one launch per
  projection) and the other 8 ``fp8_dptp128c_acc`` per layer in ``mlp(W)`` (the experts' weight gradients,
  two streams at once): **38.66 ms** of the GPU (each overlapped microsecond split equally among the GEMMs
  running; their durations add to 43.92 ms).

Left out: the router's BF16 cuBLAS GEMMs (0.54 ms, not FP8) and DeepGEMM's layout transposes (0.50 ms,
memory-bound). :func:`trace_gemm_seconds` reads these figures from the trace; :func:`derive_fp8_rates` finds
the profile rates with which the step-time model's own kernel function (:mod:`k2.launcher.planning.kernels`: roofline,
tile and wave quantization, launch cost; at 112/132 of the rate as it prices DualPipe) gives the same
seconds for the same chunk pair. The rates are a measurement of the hardware at training shapes, not a fit
to any run's step time. Own code: no library reads kernel classes out of a profiler trace.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING

from k2.launcher.planning.hardware import HardwareProfile
from k2.launcher.planning.stage_model import StageModel
from k2.launcher.planning.what_if import WhatIf

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig

#: the trace's chunk pair: tokens per microbatch, MoE layers per chunk, EP size
TRACE_TOKENS, TRACE_LAYERS, TRACE_EP = 4096, 4, 64
#: seconds of the trace's FP8 GEMMs (module docstring), as :func:`trace_gemm_seconds` reads them
TRACE_GEMM_S = {"dense": 30.597e-3, "expert": 38.661e-3}

_PREFIX = "grouped_gemm::cuda::"
_MLP_W_KERNELS = 10  # fp8_dptp128c_acc per layer in mlp(W): the shared expert's 2, the 4 experts' 2 each


def trace_gemm_seconds(trace: dict) -> dict[str, float]:
    """Seconds of the dense and of the expert FP8 GEMMs in a DeepSeek profile-data training trace.

    Args:
        trace: the parsed ``train.json`` (Chrome trace: ``traceEvents`` with ``kernel``, ``cuda_runtime``
            and ``user_annotation`` events; a kernel's phase is the annotation (``attn(F)``, ``mlp(W)``, ...)
            around its launch).

    Returns:
        ``{"dense": s, "expert": s}``; where GEMMs overlap in time each gets an equal share of the overlap,
        so the two add to the time the GPU spent in GEMMs.

    Raises:
        KeyError: a kernel whose launch is not in the trace.
    """
    ev = trace["traceEvents"]
    launch = {
        e["args"]["correlation"]: e["ts"]
        for e in ev
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    ann = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev if e.get("cat") == "user_annotation")
    gemms = []
    mlp_w = 0
    for e in sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"]):
        name = e["name"]
        if _PREFIX not in name or "::utils::" in name:
            continue
        kind = name.split(_PREFIX)[1].split("::")[0]
        t = launch[e["args"]["correlation"]]
        phase = [a for s, f, a in ann if s <= t <= f][-1:]
        if kind.startswith("m_grouped"):
            cls = "expert"
        elif phase == ["mlp(W)"]:
            cls = "dense" if mlp_w % _MLP_W_KERNELS in (0, _MLP_W_KERNELS - 1) else "expert"
            mlp_w += 1
        else:
            cls = "dense"
        gemms.append((e["ts"], e["ts"] + e["dur"], cls))
    out: dict[str, float] = defaultdict(float)
    edges = sorted({x for s, f, _ in gemms for x in (s, f)})
    for a, b in zip(edges, edges[1:]):
        running = [c for s, f, c in gemms if s <= a and f >= b]
        for c in running:
            out[c] += (b - a) / len(running) * 1e-6  # trace times in microseconds
    return {"dense": out["dense"], "expert": out["expert"]}


def chunk_gemm_seconds(
    model_cfg: ModelConfig,
    profile: HardwareProfile,
    dense_tflops: float,
    grouped_tflops: float,
    recompute: tuple = ("mla_up_proj",),
) -> dict[str, float]:
    """The step-time model's seconds for the trace's FP8 GEMMs: ``TRACE_LAYERS`` MoE layers of
    ``model_cfg`` (DeepSeek-V3), forward, input gradient (B) and weight gradient (W) of ``TRACE_TOKENS``
    tokens at EP ``TRACE_EP``, MLA's up-projections recomputed (DeepSeek-V3, arXiv 2412.19437 section
    3.2.3), at ``dense_tflops`` / ``grouped_tflops`` x the share of the SMs DualPipe leaves to compute
    (the profile's ``compute_units`` less ``deepep_comm_units``: 112 of 132 on H800, as in the trace).
    The router (BF16 in the trace) is left out on both sides. Returns ``{"dense": s, "expert": s}``."""
    fraction = 1.0 - profile.comm_share(deepep=True)
    rates = dataclasses.replace(
        profile.rates("bf16", fp8=True),
        gemm_flops=dense_tflops * 1e12 * fraction,
        grouped_gemm_flops=grouped_tflops * 1e12 * fraction,
    )
    m = StageModel(
        model_cfg,
        None,
        None,
        tokens=TRACE_TOKENS,
        profile=profile,
        rates=rates,
        act_bytes=2.0,
        grouped=True,
        what_if=WhatIf(),
        recompute=recompute,
    )
    out = {"F": {}, "B": {}, "W": {}}
    m.attention_gemms(out, tag="dense")
    m.expert_gemms(out, TRACE_EP, expert_tag="expert", shared_tag="dense")
    per_layer = {c: sum(out[ph].get(c, 0.0) for ph in out) for c in ("dense", "expert")}
    if "mla_up_proj" in recompute:
        per_layer["dense"] += m.up_proj_recompute_s()
    return {c: TRACE_LAYERS * v for c, v in per_layer.items()}


def derive_fp8_rates(
    model_cfg: ModelConfig, profile: HardwareProfile, measured: dict | None = None
) -> dict[str, float]:
    """The profile's ``gemm_fp8_tflops`` and ``gemm_grouped_fp8_tflops`` (TFLOP/s on all 132 SMs) with
    which :func:`chunk_gemm_seconds` equals ``measured`` (default :data:`TRACE_GEMM_S`), each found by
    bisection (the model's seconds fall as the rate rises). Returns ``{"gemm_fp8_tflops": ...,
    "gemm_grouped_fp8_tflops": ...}``.

    Raises:
        ValueError: no rate in 10-10,000 TFLOP/s gives the measured seconds (e.g. below the launch floor).
    """
    measured = TRACE_GEMM_S if measured is None else measured
    out = {}
    for cls, key in (("dense", "gemm_fp8_tflops"), ("expert", "gemm_grouped_fp8_tflops")):

        def sec(x, cls=cls):
            return chunk_gemm_seconds(model_cfg, profile, x, x)[cls]

        lo, hi = 10.0, 10_000.0
        if not sec(hi) <= measured[cls] <= sec(lo):
            raise ValueError(f"trace_rates: no {key} in 10-10,000 TFLOP/s gives {measured[cls]:.4g} s")
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sec(mid) > measured[cls] else (lo, mid)
        out[key] = (lo + hi) / 2
    return out
