"""``k2-bench bench=attention``: the core-attention backends and QK-Clip's max-logit pass, against a
plain-torch reference (also the reference of the attention tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.launcher.benchmarks.common import DTYPES, bench_options, time_calls
from k2.model.attention import K2CoreAttention

if TYPE_CHECKING:
    from k2.config.schema import K2Config


def reference_attention(q, k, v, scale: float):
    """Plain-torch causal attention, the reference for ``K2CoreAttention``.

    ``out = softmax(q k^T * scale + M) v`` with ``M[i, j] = -inf`` for ``j > i`` (softmax in at least
    fp32).

    Args:
        q: ``[s, b, h, dk]`` (megatron's layout), k: ``[s, b, h, dk]``, v: ``[s, b, h, dv]``.
        scale: softmax scale.

    Returns:
        ``(out [s, b, h * dv], per_head_max_logit [h] fp32)``; the max is over batch and unmasked
        positions of ``q k^T * scale``.
    """
    import torch

    s, b, h, _ = q.shape
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    acc = torch.promote_types(scores.dtype, torch.float32)  # fp32 softmax for bf16, fp64 stays fp64
    probs = torch.softmax(scores.to(acc), dim=-1).to(v.dtype)
    out = torch.matmul(probs, vb)  # [b, h, s, dv]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1), scores.float().amax(dim=(0, 2, 3))


_ATTENTION_DEFAULTS = {
    "batch": 2,
    "heads": 4,
    "seq_length": 256,
    "qk_head_dim": 48,
    "v_head_dim": 32,
    "dtype": "fp32",
    "cuda_batch": 1,
    "cuda_heads": 64,
    "cuda_seq_length": 4096,
    "cuda_qk_head_dim": 192,
    "cuda_v_head_dim": 128,
    "cuda_dtype": "bf16",
    "devices": "auto",
    "warmup": 2,
    "repeats": 10,
    "seed": 0,
}


def _attention_case(
    device: str, b: int, h: int, s: int, dk: int, dv: int, dtype_name: str, warmup: int, repeats: int, seed: int
) -> dict[str, Any]:
    """One shape's figures: K2CoreAttention's output and max logits against :func:`reference_attention`'s on
    the same inputs, and the time per call of each (ms, median of ``repeats``)."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    q, k, v = _random_qkv(device, b, h, s, dk, dv, dtype, seed)
    tcfg = TransformerConfig(
        num_layers=1,
        hidden_size=h * dk,
        num_attention_heads=h,
        kv_channels=dk,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=dtype,
    )

    def make(record: bool, max_logit_kernel: str = "torch"):
        m = K2CoreAttention(
            tcfg,
            1,
            AttnMaskType.causal,
            "self",
            k_channels=dk,
            v_channels=dv,
            record_max_logits=record,
            max_logit_kernel=max_logit_kernel,
        )
        return m.to(device).train()  # max logits are recorded in training forwards

    from k2.model.max_logit_kernel import available as triton_max_logit_available

    k2_rec, k2_plain = make(True), make(False)
    # the Triton max-logit kernel (model.max_logit_kernel=triton) where it runs: CUDA
    k2_tri = make(True, "triton") if device == "cuda" and triton_max_logit_available(q.device) else None
    scale = k2_rec.softmax_scale  # 1 / sqrt(dk)
    with torch.no_grad():
        out_k2 = k2_rec(q, k, v, None)
        out_ref, ref_max = reference_attention(q, k, v, scale)
        figures: dict[str, Any] = {
            "device": device,
            "dtype": dtype_name,
            "shape_sbhd": [s, b, h, dk],
            "v_head_dim": dv,
            "max_abs_diff": (out_k2.float() - out_ref.float()).abs().max().item(),
            "max_logit_abs_diff": (k2_rec.max_logits - ref_max).abs().max().item(),
        }
        calls = {
            "k2_record": lambda: k2_rec(q, k, v, None),
            "k2_no_record": lambda: k2_plain(q, k, v, None),
            "reference": lambda: reference_attention(q, k, v, scale),
        }
        if k2_tri is not None:
            k2_tri(q, k, v, None)
            figures["max_logit_abs_diff_triton"] = (k2_tri.max_logits - ref_max).abs().max().item()
            calls["k2_record_triton"] = lambda: k2_tri(q, k, v, None)
        if dtype != torch.float32:  # how far each is from the fp32 answer on the same inputs
            out_32, _ = reference_attention(q.float(), k.float(), v.float(), scale)
            figures["k2_max_abs_diff_vs_fp32"] = (out_k2.float() - out_32).abs().max().item()
            figures["reference_max_abs_diff_vs_fp32"] = (out_ref.float() - out_32).abs().max().item()
            del out_32
        times = time_calls(calls, warmup, repeats, cuda=device == "cuda")
    flops = 2 * b * h * s * s * (dk + dv)  # q k^T and p v over the full square (no causal skipping)
    return {**figures, **_time_figures(times, flops)}


def _random_qkv(device: str, b: int, h: int, s: int, dk: int, dv: int, dtype, seed: int) -> tuple:
    """Random ``q``, ``k`` ([s, b, h, dk]) and ``v`` ([s, b, h, dv]), drawn on the CPU from ``seed``, then moved
    to ``device`` in ``dtype``."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k = (torch.randn(s, b, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(s, b, h, dv, generator=gen)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def _time_figures(times: dict[str, float], flops: float) -> dict[str, float]:
    """The timing figures of one shape from its calls' times (ms, :func:`time_calls`) and its FLOPs per call:
    the times, K2 over the reference, the max-logit recording's overhead, K2's TFLOP/s."""
    figures = {
        "time_k2_ms": times["k2_record"],
        "time_k2_no_record_ms": times["k2_no_record"],
        "time_reference_ms": times["reference"],
        "k2_over_reference": times["k2_record"] / times["reference"],
        "max_logit_overhead": times["k2_record"] / times["k2_no_record"] - 1.0,
        "k2_tflops": flops / (times["k2_record"] * 1e-3) / 1e12,
    }
    if "k2_record_triton" in times:
        figures.update(
            time_k2_triton_ms=times["k2_record_triton"],
            max_logit_overhead_triton=times["k2_record_triton"] / times["k2_no_record"] - 1.0,
        )
    return figures


def bench_attention(cfg: K2Config) -> dict[str, Any]:
    """K2CoreAttention vs a plain-torch reference: max |diff|, times, max-logit recording overhead.

    Per case (``cpu`` always unless ``devices=cuda``; ``cuda`` when a GPU is present, with K2's
    shape: 64 heads, qk 192 / v 128, s 4096, bf16) the figures are

    * ``max_abs_diff``: max over elements of ``|K2CoreAttention - reference|`` (outputs ``[s, b, h*dv]``,
      same inputs, same dtype); ``max_logit_abs_diff``: ``|recorded - reference|`` per-head max logit;
    * with bf16 also each one's max |diff| against the fp32 reference on the same (bf16) inputs;
    * ``time_k2_ms`` (record_max_logits=True), ``time_k2_no_record_ms``, ``time_reference_ms``: forward,
      training mode, no autograd graph; ``k2_over_reference`` = time ratio;
      ``max_logit_overhead`` = ``time_k2 / time_k2_no_record - 1`` (fraction); on CUDA with Triton also
      ``time_k2_triton_ms``, ``max_logit_overhead_triton`` and ``max_logit_abs_diff_triton`` for
      ``max_logit_kernel=triton`` (model/max_logit_kernel.py);
      ``k2_tflops`` = ``2 b h s^2 (dk + dv)`` / time (dense square count).

    Raises:
        ConfigError: a bad option (unknown, wrong type, dtype not fp32/bf16, devices=cuda without GPU).
    """
    import torch

    o = bench_options(cfg, _ATTENTION_DEFAULTS)
    for key in ("dtype", "cuda_dtype"):
        if o[key] not in DTYPES:
            raise ConfigError(f"bench.options.{key}={o[key]!r}; allowed: {', '.join(DTYPES)}")
    if o["devices"] not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"bench.options.devices={o['devices']!r}; allowed: auto, cpu, cuda")
    if o["devices"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError("bench.options.devices=cuda but no CUDA device is available; allowed: auto, cpu")
    for key in (
        "batch",
        "heads",
        "seq_length",
        "qk_head_dim",
        "v_head_dim",
        "cuda_batch",
        "cuda_heads",
        "cuda_seq_length",
        "cuda_qk_head_dim",
        "cuda_v_head_dim",
        "repeats",
    ):
        if o[key] < 1:
            raise ConfigError(f"bench.options.{key}={o[key]} must be >= 1")
    if o["warmup"] < 0:
        raise ConfigError(f"bench.options.warmup={o['warmup']} must be >= 0")

    figures: dict[str, Any] = {}
    if o["devices"] in ("auto", "cpu"):
        figures["cpu"] = _attention_case(
            "cpu",
            o["batch"],
            o["heads"],
            o["seq_length"],
            o["qk_head_dim"],
            o["v_head_dim"],
            o["dtype"],
            o["warmup"],
            o["repeats"],
            o["seed"],
        )
    if o["devices"] in ("auto", "cuda") and torch.cuda.is_available():
        figures["cuda"] = _attention_case(
            "cuda",
            o["cuda_batch"],
            o["cuda_heads"],
            o["cuda_seq_length"],
            o["cuda_qk_head_dim"],
            o["cuda_v_head_dim"],
            o["cuda_dtype"],
            o["warmup"],
            o["repeats"],
            o["seed"],
        )
    return figures
