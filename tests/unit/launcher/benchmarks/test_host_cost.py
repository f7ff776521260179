"""k2-bench bench=host_cost's extrapolation to no tokens (launcher/benchmarks/host_cost.py): the least-squares
line's value at zero, kept within [0, the smallest size's time]."""

from __future__ import annotations

import pytest

from k2.launcher.benchmarks.host_cost import _extrapolate


def test_the_line_through_the_sizes_at_no_tokens():
    # 5 ms + 0.1 ms per token, measured at 8, 16, 32 tokens: 5 ms at none
    assert _extrapolate([8, 16, 32], [5.8e-3, 6.6e-3, 8.2e-3]) == pytest.approx(5e-3)


def test_noise_that_tilts_the_line_down_is_clamped_to_the_smallest_size():
    # faster at more tokens (a shared machine's noise): the line at zero lies above every run; the smallest's stands
    assert _extrapolate([8, 16, 32], [5e-3, 4.5e-3, 4e-3]) == pytest.approx(4e-3)
