"""K2's schedule in closed form, written from the report's numbers (docs/k2_reference.md "Schedule"),
never read back from the code under test: the reference of the schedule and plan tests."""

from __future__ import annotations

import math

# K2 report / docs/k2_reference.md "Schedule"
K2_BATCH_TOKENS = 16_384 * 4_096  # 67,108,864
T = 10**12
PEAK, DECAY_END, ANNEAL_END = 2e-4, 2e-5, 7e-6


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def k2_lr(tokens: float) -> float:
    """K2's LR after ``tokens`` tokens, written from the report's description."""
    warm_end = 500 * K2_BATCH_TOKENS
    if tokens <= warm_end:
        return PEAK * tokens / warm_end
    if tokens <= 10 * T:
        return PEAK
    if tokens <= 15.5 * T:
        r = (tokens - 10 * T) / (5.5 * T)
        return DECAY_END + (PEAK - DECAY_END) * 0.5 * (1 + math.cos(math.pi * r))
    r = min(1.0, (tokens - 15.5 * T) / (0.46 * T))  # 400B + 60B, one linear anneal
    return DECAY_END + (ANNEAL_END - DECAY_END) * r
