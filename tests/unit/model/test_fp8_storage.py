"""FP8-E4M3 1 x 128 tile storage (model/fp8_storage.py) against an independent reference.

The reference rounds to E4M3 in plain Python floats (``math.frexp``, round half to even, 3 mantissa bits,
subnormal step 2^-9, max 448), without torch's float8 cast, from the same FP32 products ``x * scale``;
payload and scales must match it bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from k2.model.fp8_storage import E4M3_MAX, TILE, dequantize_tiles, quantize_tiles


def ref_e4m3(v: float) -> float:
    """Round-to-nearest-even onto E4M3 (fn variant: max 448, no infinities; NaN stays NaN)."""
    if math.isnan(v) or math.isinf(v):
        return math.nan
    if v == 0.0:
        return 0.0
    m, e = math.frexp(abs(v))  # |v| = m * 2^e, m in [0.5, 1)
    exp = e - 1  # |v| = (2m) * 2^exp, 2m in [1, 2)
    step = 2.0 ** (max(exp, -6) - 3)  # 3 mantissa bits; below 2^-6 the subnormal step 2^-9
    q = round(abs(v) / step) * step  # Python round(): half to even
    return math.copysign(min(q, E4M3_MAX), v)


def ref_quantize(row: list) -> tuple[list, list]:
    """Reference quantization of one row, tile by tile: (E4M3 values, one scale per tile), from the FP32
    products ``x * scale`` as the code computes them."""
    q, scales = [], []
    for start in range(0, len(row), TILE):
        tile = row[start : start + TILE]
        amax = max((abs(v) for v in tile if math.isfinite(v)), default=0.0)
        scale = (
            float(torch.tensor(E4M3_MAX, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32))
            if amax > 0
            else 1.0
        )
        scales.append(scale)
        for v in tile:
            q.append(ref_e4m3(float(torch.tensor(v, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32))))
    return q, scales


def check_row(x_row: torch.Tensor, t_data_row: torch.Tensor, t_scale_row: torch.Tensor, y_row: torch.Tensor):
    """Payload and scales bit-exact against the reference; the round trip q / scale to FP32 rounding."""
    q, scales = ref_quantize(x_row.tolist())
    assert t_data_row.float().tolist() == q
    assert t_scale_row.tolist() == scales
    expect = torch.tensor(q) / torch.tensor(scales).repeat_interleave(TILE)[: len(q)]
    torch.testing.assert_close(y_row, expect, rtol=2.0**-23, atol=0.0)


@pytest.mark.parametrize("n", [1, 64, 128, 200, 300])
def test_matches_independent_reference(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=gen) * torch.tensor([1e-3, 1.0, 50.0]).unsqueeze(1)
    t = quantize_tiles(x)
    y = dequantize_tiles(t)
    for r in range(3):
        check_row(x[r], t.data[r], t.scale[r], y[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundtrip_error_on_normal_data(dtype):
    """Per tile (128 elements): relative L2 error below the hard E4M3 bound 2^-4 in every tile, 2.6 % on
    average (the issue's 3 % target), and every element in E4M3's normal range within 2^-4 relative."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=gen).to(dtype)
    y = dequantize_tiles(quantize_tiles(x))
    assert y.dtype == dtype and y.shape == x.shape
    xt, yt = x.float().view(-1, TILE), y.float().view(-1, TILE)
    tile_err = (yt - xt).norm(dim=-1) / xt.norm(dim=-1)
    assert tile_err.max() < 2.0**-4
    assert tile_err.mean() < 0.03
    amax = xt.abs().amax(dim=-1, keepdim=True)
    normal = xt.abs() >= amax * 2.0**-6 / E4M3_MAX
    assert ((yt - xt).abs() / xt.abs())[normal].max() <= 2.0**-4


def test_zeros_exact_and_zero_tiles_safe():
    x = torch.zeros(4, 300)
    x[1, 130:140] = torch.arange(1.0, 11.0)  # one non-zero tile next to zero tiles
    t = quantize_tiles(x)
    assert torch.isfinite(t.scale).all()
    y = dequantize_tiles(t)
    assert torch.equal(y[0], x[0]) and torch.equal(y[2:], x[2:])
    assert torch.equal(y[1, :128], x[1, :128]) and torch.equal(y[1, 256:], x[1, 256:])


def test_exact_for_values_representable_after_scaling():
    """Values that are E4M3 numbers times 2^k with the tile's amax at 448 * 2^k come back exactly."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)]  # the 254 finite E4M3 values, 448 among them
    for k in (-10, 0, 7):
        x = e4m3[torch.randperm(len(e4m3), generator=torch.Generator().manual_seed(k))][:200] * 2.0**k
        x[0] = E4M3_MAX * 2.0**k  # each 128-tile's amax is 448 * 2^k ...
        x[128] = -E4M3_MAX * 2.0**k  # ... so its scale is 2^-k, exact
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            assert torch.equal(dequantize_tiles(quantize_tiles(xd)), xd)


@pytest.mark.parametrize("shape", [(5, 1), (2, 3, 129), (7, 255), (1, 1000)])
def test_last_dim_not_a_multiple_of_128(shape):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen)
    x[..., -1] = 1000.0  # the short last tile has its own scale (checked against the reference)
    t = quantize_tiles(x)
    assert t.data.shape == x.shape and t.scale.shape == (*shape[:-1], math.ceil(shape[-1] / TILE))
    y = dequantize_tiles(t)
    assert y.shape == x.shape
    flat = [a.reshape(-1, a.shape[-1]) for a in (x, t.data, t.scale, y)]
    for r in range(flat[0].shape[0]):
        check_row(*(a[r] for a in flat))


def test_nan_and_inf_propagate():
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    x[0, 3] = float("nan")
    x[0, 200] = float("inf")
    x[1, 5] = -float("inf")
    y = dequantize_tiles(quantize_tiles(x))
    assert torch.isnan(y[0, 3]) and torch.isnan(y[0, 200]) and torch.isnan(y[1, 5])
    finite = torch.isfinite(x)
    assert torch.isfinite(y[finite]).all()  # the tile's other values keep a finite scale
    rel = ((y - x).abs() / x.abs())[finite & (x.abs() > 1e-3)]
    assert rel.max() <= 2.0**-4


def test_non_contiguous_input_and_bytes():
    base = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    x = base[:, 256:]  # a view with row stride 512 (as SwiGLU's halves of the fc1 output)
    t = quantize_tiles(x)
    assert torch.equal(dequantize_tiles(t), dequantize_tiles(quantize_tiles(x.contiguous())))
    assert t.nbytes == 64 * 256 * 1 + 64 * 2 * 4
