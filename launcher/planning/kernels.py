"""Seconds of one kernel from its shape: the roofline with tile and wave quantization and a per-kernel floor.

The step-time model of ``k2-plan`` (``launcher/planning/step_time.py``) prices every matrix product, core
attention and element-wise kernel of a layer with these functions and a device's rates
(:class:`KernelRates`, from a hardware profile: ``recipes/hardware/*.yaml`` or ``k2-bench bench=hardware``).
Nothing in megatron-core, Megatron-Bridge or torchtitan estimates kernel times, hence our own.

Rules (NVIDIA "Matrix Multiplication Background User's Guide", sections "Math and Memory Bounds",
"Tile Quantization", "Wave Quantization"):

* a kernel takes ``max(FLOPs / achieved FLOP/s, bytes / achieved bytes/s)`` (the roofline) plus ``launch_s``
  (launch and tail of one kernel on the stream; on a CPU, the framework's per-operator dispatch cost, which
  ``k2-bench bench=hardware`` measures, and which is paid in series with the arithmetic);
* a GEMM's output ``[m, n]`` is computed in ``tile x tile`` tiles: a dimension that is not a multiple of the
  tile costs the whole last tile (tile quantization), and the tiles run in waves of ``units`` at a time
  (SMs on a GPU): a last, partial wave costs a whole wave (wave quantization). ``tile = 1`` / ``units =
  None`` turn these off (a CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "WGRAD_OUT_BYTES",
    "KernelRates",
    "gemm_seconds",
    "grouped_gemm_seconds",
    "elementwise_seconds",
    "attention_seconds",
]


@dataclass(frozen=True)
class KernelRates:
    """Achieved rates of one device for the kernels of a training step.

    Attributes:
        gemm_flops: achieved FLOP/s of a large GEMM in the precision the GEMMs run in (e.g. 795e12 for
            BF16 on Hopper; FLOPs counted as ``2 m k n``).
        attention_flops: achieved FLOP/s of core attention (forward and backward; FLOPs as
            :mod:`k2.model.flops` counts them).
        memory_bytes: achieved bytes/s of element-wise (memory-bound) kernels.
        launch_s: seconds one kernel adds beyond its roofline time (launch and tail; a CPU's dispatch).
        tile: GEMM output tile edge (elements) for tile quantization; 1 = none.
        units: tiles computed at once (SMs); None = no wave quantization.
        gemm_bytes_per_element: bytes per GEMM operand element (2 BF16, 1 FP8, 4 FP32).
        grouped_gemm_flops: achieved FLOP/s of a grouped GEMM (several experts in one launch); None = as
            ``gemm_flops``.
    """

    gemm_flops: float
    attention_flops: float
    memory_bytes: float
    launch_s: float = 0.0
    tile: int = 1
    units: int | None = None
    gemm_bytes_per_element: float = 2.0
    grouped_gemm_flops: float | None = None


def _quantized_efficiency(m: int, n: int, groups: int, rates: KernelRates) -> float:
    """Useful fraction of the tiles' work: tile quantization on ``m`` and ``n``, wave quantization over
    ``groups`` GEMMs' tiles together (a grouped GEMM is one launch)."""
    t = rates.tile
    tiles_m, tiles_n = math.ceil(m / t), math.ceil(n / t)
    useful = (m * n) / (tiles_m * tiles_n * t * t)
    if rates.units:
        tiles = tiles_m * tiles_n * groups
        useful *= tiles / (math.ceil(tiles / rates.units) * rates.units)
    return useful


#: bytes per element of a weight gradient GEMM's output: it adds into the FP32 gradient buffer, reading and
#: writing it (megatron's ``gradient_accumulation_fusion``: Transformer Engine's weight-gradient GEMM with
#: ``accumulate=True`` on ``main_grad``; DeepGEMM's ``*_acc`` kernels in DeepSeek-V3's training profile)
WGRAD_OUT_BYTES = 4 + 4


def _out_bytes(rates: KernelRates) -> float:
    """Bytes per output element of a forward or input-gradient GEMM: its operands' width, at least BF16's
    (an FP8 GEMM writes its output in BF16)."""
    return max(rates.gemm_bytes_per_element, 2.0)


def grouped_gemm_seconds(
    groups: int, m: float, k: int, n: int, rates: KernelRates, out_bytes: float | None = None
) -> float:
    """Seconds of ``groups`` GEMMs ``[m, k] x [k, n]`` run as one grouped kernel (``groups = 1``: one GEMM).

    Args:
        groups: GEMMs in the launch (e.g. the local experts of an MoE layer).
        m, k, n: the shape of each (``m`` may be fractional: an average token count; rounded up).
        rates: the device's :class:`KernelRates`.
        out_bytes: bytes moved per element of the output ``[m, n]`` (default: written once in the operands'
            width, BF16 at least; a weight gradient: :data:`WGRAD_OUT_BYTES`).

    Returns:
        seconds; 0 for an empty product.
    """
    m = int(math.ceil(m))
    if groups <= 0 or m <= 0 or k <= 0 or n <= 0:
        return 0.0
    flops = 2.0 * groups * m * k * n
    out = _out_bytes(rates) if out_bytes is None else out_bytes
    nbytes = groups * ((m * k + k * n) * rates.gemm_bytes_per_element + m * n * out)
    rate = rates.grouped_gemm_flops if groups > 1 and rates.grouped_gemm_flops else rates.gemm_flops
    compute = flops / (rate * _quantized_efficiency(m, n, groups, rates))
    return max(compute, nbytes / rates.memory_bytes) + rates.launch_s


def gemm_seconds(m: float, k: int, n: int, rates: KernelRates, out_bytes: float | None = None) -> float:
    """Seconds of one GEMM ``[m, k] x [k, n]`` (:func:`grouped_gemm_seconds` with one group)."""
    return grouped_gemm_seconds(1, m, k, n, rates, out_bytes)


def elementwise_seconds(nbytes: float, kernels: int, rates: KernelRates) -> float:
    """Seconds of ``kernels`` memory-bound kernels moving ``nbytes`` in all: ``nbytes / memory_bytes +
    kernels x launch_s``."""
    return max(nbytes, 0.0) / rates.memory_bytes + max(kernels, 0) * rates.launch_s


def attention_seconds(flops: float, rates: KernelRates, kernels: int = 1) -> float:
    """Seconds of core attention of ``flops`` FLOPs in ``kernels`` launches."""
    return flops / rates.attention_flops + kernels * rates.launch_s if flops > 0 else 0.0
