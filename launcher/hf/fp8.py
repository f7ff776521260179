"""FP8 block-quantized weights of DeepSeek-V3 / Kimi K2 HF checkpoints.

Published K2 / DeepSeek-V3 checkpoints store each linear weight ``W [M, N]`` as FP8-E4M3 plus a tensor
``<name>_scale_inv [ceil(M / 128), ceil(N / 128)]`` (FP32): one scale per 128 x 128 block, the last block
row / column partial when ``M`` or ``N`` is not a multiple of 128; ``config.json`` says so in
``quantization_config`` (``quant_method: fp8``, ``weight_block_size: [128, 128]``). The real weight is
``W[r, c] * scale_inv[r // 128, c // 128]`` (DeepSeek-V3 ``inference/fp8_cast_bf16.py``,
``weight_dequant``).
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
#: the same dtypes as a safetensors header names them
FP8_HEADER_DTYPES = ("F8_E4M3",)


def block_size(hf_config: dict) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of ``config.json`` (default 128 x 128)."""
    q = hf_config.get("quantization_config") or {}
    b = q.get("weight_block_size") or [128, 128]
    return int(b[0]), int(b[1])


def scale_shape(shape, block: tuple[int, int] = (128, 128)) -> tuple[int, int]:
    """Shape of the ``weight_scale_inv`` of an ``[M, N]`` weight: one entry per block, the edge blocks
    partial: ``(ceil(M / bm), ceil(N / bn))``."""
    (m, n), (bm, bn) = shape, block
    return -(-int(m) // bm), -(-int(n) // bn)


def dequantize(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``weight [M, N]`` (FP8) times its per-block ``scale_inv [ceil(M/bm), ceil(N/bn)]``, as ``dtype``.

    Raises:
        ValueError: ``scale_inv`` does not have one entry per block of ``weight``.
    """
    m, n = weight.shape
    bm, bn = block
    want = scale_shape((m, n), block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale shape {tuple(scale_inv.shape)}, expected {want} for a [{m}, {n}] weight in {bm} x {bn} blocks"
        )
    scale = scale_inv.float().repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return (weight.float() * scale).to(dtype)
