"""Per-head max pre-softmax logit for QK-Clip without materialising the scores: one Triton kernel.

Why our own kernel: QK-Clip (K2 report section 2.1, docs/k2_reference.md) needs, per head, the maximum of
``scale * q_i . k_j`` over the unmasked positions of every microbatch. cuDNN's SDPA (the only fused
kernel for MLA's qk 192 / v 128 head dims without Transformer Engine) does not return it, and
:func:`k2.model.attention.per_head_max_logit` gets it from a chunked ``q k^T`` in torch, which writes every
score block to memory and reads it back for the max: on one H200 that pass cost 2.9x the attention
forward kernel itself (docs/results.md, "Core attention on one H200"). This kernel computes the same ``q k^T``
tiles in registers (``tl.dot``, FP32 accumulation) and keeps only a running row maximum, like the
first half of a flash-attention forward without the softmax: ``b x heads x ceil(sq / BLOCK_M)`` block
maxima go to memory, nothing else. Causal masking skips the key tiles above the diagonal.

Status: opt-in (``model.max_logit_kernel=triton``) until it is measured on a GPU; tested here with Triton's CPU
interpreter (``TRITON_INTERPRET=1``) against a float64 reference
(``tests/unit/model/test_max_logit_kernel.py``).
"""

from __future__ import annotations

import math
import os

import torch

try:  # Triton ships with torch's CUDA builds; absent elsewhere
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["available", "per_head_max_logit_triton"]


def available(device: torch.device) -> bool:
    """True where the kernel can run: Triton importable and a CUDA tensor (or the CPU interpreter,
    ``TRITON_INTERPRET=1``, for tests)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _block_max_kernel(
        Q,
        K,
        Out,
        stride_qb,
        stride_qh,
        stride_qs,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_kd,
        H,
        SQ,
        D,
        OFFSET,
        NUM_M,
        SK: tl.constexpr,
        CAUSAL: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < SQ) & (offs_d[None, :] < D), other=0.0)
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        # causal: query row i sees keys j <= i + OFFSET (aligned to the end when SK > SQ), so key tiles
        # starting past this block's last row + OFFSET are skipped. The loop bound is the compile-time SK
        # (one compile per key length) and the skip a branch: Triton 3.6's CPU interpreter (numpy 2)
        # cannot take a runtime loop bound
        last_visible = (pid_m + 1) * BLOCK_M - 1 + OFFSET
        for start_n in range(0, SK, BLOCK_N):
            if (not CAUSAL) or (start_n <= last_visible):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                k_ptrs = K + b * stride_kb + h * stride_kh + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd
                k = tl.load(k_ptrs, mask=(offs_n[None, :] < SK) & (offs_d[:, None] < D), other=0.0)
                if IEEE:
                    s = tl.dot(q, k, input_precision="ieee")
                else:
                    s = tl.dot(q, k)
                valid = (offs_n[None, :] < SK) & (offs_m[:, None] < SQ)
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
                s = tl.where(valid, s, float("-inf"))
                row_max = tl.maximum(row_max, tl.max(s, 1))
        tl.store(Out + pid_bh * NUM_M + pid_m, tl.max(row_max, 0))


def per_head_max_logit_triton(
    query: torch.Tensor, key: torch.Tensor, softmax_scale: float, causal: bool, block_m: int = 64, block_n: int = 64
) -> torch.Tensor:
    """Per-head max of ``softmax_scale * q_i . k_j`` over batch and unmasked positions (causal or none).

    Same contract as :func:`k2.model.attention.per_head_max_logit` without ``attention_mask``; the dot
    products accumulate in FP32 (BF16 inputs: not rounded to BF16 before the max, so the result can
    differ from the torch path by one BF16 rounding of the logit; FP32 inputs: IEEE FP32 products, no
    TF32).

    Args:
        query: ``[b, np, sq, hk]`` (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        key: ``[b, np, sk, hk]``.
        softmax_scale: positive scale of the logits.
        causal: mask ``j > i + (sk - sq)``.
        block_m, block_n: query / key rows per tile (powers of 2, >= 16).

    Returns:
        ``[np]`` FP32; ``-inf`` for a head that saw no unmasked position.

    Raises:
        RuntimeError: Triton unavailable for this device (see :func:`available`).
        ValueError: mismatched shapes or a non-positive scale.
    """
    if not available(query.device):
        raise RuntimeError("per_head_max_logit_triton needs Triton and a CUDA device (or TRITON_INTERPRET=1)")
    b, h, sq, d = query.shape
    if key.shape[0] != b or key.shape[1] != h or key.shape[3] != d:
        raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} do not match")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale={softmax_scale} must be positive (max and scale commute only then)")
    sk = key.shape[2]
    num_m = triton.cdiv(sq, block_m)
    out = torch.empty((b * h, num_m), device=query.device, dtype=torch.float32)
    block_d = max(16, 1 << math.ceil(math.log2(d)))
    _block_max_kernel[(num_m, b * h)](
        query,
        key,
        out,
        *query.stride(),
        *key.stride(),
        h,
        sq,
        d,
        sk - sq,
        num_m,
        sk,
        CAUSAL=bool(causal),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        IEEE=query.dtype == torch.float32,
    )
    return out.view(b, h, num_m).amax(dim=(0, 2)) * softmax_scale
