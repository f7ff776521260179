"""The scaling-law fit on arrays: exact recovery without noise (with and without an irreducible term), the
Huber loss's robustness to one bad point, the inverse of the law, weights as bootstrap multiplicities, the
convergence flag of a flat arm, and the seed resamples and percentile intervals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from k2.launcher.tools.sweep_fit import HUBER_DELTA, PowerLaw, fit_power_law, huber, percentile_interval, seed_resamples

FLOPS = np.repeat(3e10 * 2.0 ** np.arange(5), 2)  # 5 budgets x 2 seeds, a 16x range


def test_recovers_a_noise_free_power_law():
    true = PowerLaw(log_A=math.log(20.0), alpha=0.07)
    fit = fit_power_law(FLOPS, true.loss(FLOPS))
    assert fit.converged and fit.starts >= 4
    assert fit.law.alpha == pytest.approx(0.07, abs=1e-7)
    assert fit.law.A == pytest.approx(20.0, rel=1e-5)
    assert max(abs(r) for r in fit.residuals) < 1e-8


def test_recovers_an_irreducible_term():
    true = PowerLaw(log_A=math.log(30.0), alpha=0.15, E=1.5)
    fit = fit_power_law(FLOPS, true.loss(FLOPS), irreducible=True)
    assert fit.converged
    assert fit.law.E == pytest.approx(1.5, abs=2e-3) and fit.law.alpha == pytest.approx(0.15, rel=2e-3)


def test_huber_keeps_one_bad_point_from_moving_the_exponent():
    """One cell 0.2 nats high (a diverged run): least squares on ln L moves alpha by far more than the
    Huber fit does."""
    true = PowerLaw(log_A=math.log(20.0), alpha=0.07)
    loss = true.loss(FLOPS)
    loss[3] += 0.2
    robust = fit_power_law(FLOPS, loss).law.alpha
    ols = -np.polyfit(np.log(FLOPS), np.log(loss), 1)[0]
    assert abs(robust - 0.07) < 0.002 < abs(ols - 0.07)


def test_inverse_and_weights():
    law = PowerLaw(log_A=math.log(20.0), alpha=0.07, E=0.5)
    for c in (1e10, 3e12):
        assert math.exp(law.log_flops_at(float(law.loss(c)))) == pytest.approx(c, rel=1e-9)
    assert law.log_flops_at(0.5) == math.inf and PowerLaw(0.0, 0.0).log_flops_at(0.9) == math.inf
    # weight 2 on a point = the point twice; weight 0 = absent
    rng = np.random.default_rng(0)
    loss = PowerLaw(log_A=math.log(20.0), alpha=0.07).loss(FLOPS) * np.exp(rng.normal(0, 3e-3, FLOPS.size))
    w = np.array([2, 0, 1, 1, 0, 1, 2, 1, 1, 1])
    dup = np.repeat(np.arange(FLOPS.size), w)
    a = fit_power_law(FLOPS, loss, w).law
    b = fit_power_law(FLOPS[dup], loss[dup]).law
    assert a.alpha == pytest.approx(b.alpha, abs=1e-7) and a.log_A == pytest.approx(b.log_A, abs=1e-6)


def test_flat_arm_is_not_converged_and_too_few_budgets_is_refused():
    rising = 3.0 * (FLOPS / FLOPS[0]) ** 0.01
    fit = fit_power_law(FLOPS, rising)
    assert not fit.converged and fit.law.alpha == 0.0 and "bound" in fit.message
    with pytest.raises(ValueError, match="at least 2 distinct FLOPs"):
        fit_power_law(FLOPS[:2] * 0 + 1e12, [3.0, 3.1])
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_power_law([1e12, 2e12], [3.0, -1.0])


def test_huber_and_resamples_and_intervals():
    assert huber(np.array([HUBER_DELTA / 2])) == pytest.approx(HUBER_DELTA**2 / 8)
    assert huber(np.array([-3 * HUBER_DELTA])) == pytest.approx(HUBER_DELTA * 2.5 * HUBER_DELTA)
    counts = seed_resamples(3, 500, rng_seed=7)
    assert counts.shape == (500, 3) and (counts.sum(axis=1) == 3).all()
    assert (counts == seed_resamples(3, 500, rng_seed=7)).all()  # the same rows for the same seed
    assert len({tuple(r) for r in counts}) == 10  # every multiset of 3 seeds drawn from 3 appears
    assert percentile_interval(np.arange(101.0), 0.9) == pytest.approx((5.0, 95.0))
    assert percentile_interval([1.0, math.nan], 0.9) is None
