"""FP8-E4M3 storage of activations: 1 x 128 tiles along the last dimension, one FP32 scale per tile.

docs/k2_reference.md "Training system", "Activation memory": K2 keeps the MoE up-projection inputs and the SwiGLU
inputs that autograd saves for backward in FP8-E4M3 with 1 x 128 tiles and FP32 scales; compute stays
in BF16 (no FP8 GEMMs). This module is only the number format: :func:`quantize_tiles` turns a tensor
into an FP8 payload plus scales, :func:`dequantize_tiles` turns it back. Where it is applied (which
saved tensors) is ``model/saved_tensors.py``.

Format, per tile ``T`` (128 consecutive elements of the last dimension; the last tile of a row may be
shorter when the last dimension is not a multiple of 128):

* ``amax = max |x|`` over the finite elements of ``T``;
* ``scale = 448 / amax`` (448 = largest E4M3 value), ``scale = 1`` for a tile with ``amax == 0`` (all
  zeros: stored and returned exactly);
* ``q = e4m3(clamp(x * scale, -448, 448))``; stored ``q`` (1 byte per element) and ``scale`` (FP32);
* back: ``x' = q / scale`` in FP32, cast to the original dtype.

Non-finite values are propagated, not hidden: a NaN stays NaN and +-Inf becomes NaN (E4M3 has no
infinity), and neither changes the scale of the finite values in its tile. Relative error of an element
that lands in E4M3's normal range (``|x| >= amax * 2^-6 / 448``, about ``amax / 28700``): at most 2^-4
(3 mantissa bits, round to nearest); below that, subnormals (absolute error <= ``amax * 2^-10 / 448``),
and ``|x| < amax * 2^-10 / 448`` flushes to zero.

torch has had ``torch.float8_e4m3fn`` as a storage dtype on CPU and CUDA since 2.1; the scaling and
tiling here are our own because neither torch nor megatron-core (without Transformer Engine) has a
blockwise FP8 *storage* format for saved activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TILE = 128
E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


@dataclass
class FP8Tiles:
    """A tensor stored as FP8-E4M3 tiles.

    Attributes:
        data: ``float8_e4m3fn``, the original shape ``[..., n]``, contiguous.
        scale: ``float32`` ``[..., ceil(n / 128)]``; element ``x[..., j]`` is ``data[..., j] / scale[..., j // 128]``.
        dtype: the original dtype (restored by :func:`dequantize_tiles`).
    """

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: 1 per element + 4 per tile."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def _tiled(x32: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x32`` ``[..., n]`` (FP32) as ``[rows, tiles, 128]``, zero-padded at the end of each row."""
    n = x32.shape[-1]
    tiles = -(-n // TILE)
    rows = x32.reshape(-1, n)
    pad = tiles * TILE - n
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    return rows.view(rows.shape[0], tiles, TILE), tiles


def quantize_tiles(x: torch.Tensor) -> FP8Tiles:
    """``x`` ``[..., n]`` (any float dtype, any strides) -> :class:`FP8Tiles` (see the module docstring).

    Raises:
        ValueError: ``x`` is 0-dimensional, has an empty last dimension, or is not floating point.
    """
    if x.dim() == 0 or x.shape[-1] == 0 or not x.is_floating_point():
        raise ValueError(f"quantize_tiles needs a floating tensor [..., n>0], got {x.dtype} {tuple(x.shape)}")
    shape, n = x.shape, x.shape[-1]
    x32 = x.detach().to(torch.float32)
    tiled, tiles = _tiled(x32)
    finite = torch.isfinite(tiled)
    amax = torch.where(finite, tiled.abs(), torch.zeros((), dtype=torch.float32, device=x.device)).amax(dim=-1)
    # (full_like / amax: an IEEE division; torch's scalar / tensor multiplies by the reciprocal)
    scale = torch.where(
        amax > 0, torch.full_like(amax, E4M3_MAX) / amax, torch.ones((), dtype=torch.float32, device=x.device)
    )
    scaled = tiled * scale.unsqueeze(-1)
    # clamp the finite values only (rounding of x * 448 / amax may exceed 448 by an ulp); NaN/Inf -> NaN
    scaled = torch.where(finite, scaled.clamp(-E4M3_MAX, E4M3_MAX), torch.full((), float("nan"), device=x.device))
    q = scaled.to(FP8_DTYPE).view(-1, tiles * TILE)[:, :n].reshape(shape)
    return FP8Tiles(q.contiguous(), scale.reshape(*shape[:-1], tiles).contiguous(), x.dtype)


def dequantize_tiles(t: FP8Tiles) -> torch.Tensor:
    """:class:`FP8Tiles` -> a contiguous tensor of the original shape and dtype."""
    n = t.data.shape[-1]
    q32 = t.data.to(torch.float32)
    tiled, tiles = _tiled(q32)
    x = tiled / t.scale.reshape(-1, tiles, 1)
    return x.view(-1, tiles * TILE)[:, :n].reshape(t.data.shape).to(t.dtype)
