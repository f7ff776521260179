"""The sparsity sweep's scaling-law fit: per arm ``L = A * C^(-alpha)`` (optionally ``+ E``), robust, from many
starts, with intervals from a bootstrap over seeds. Pure numpy/scipy (no torch): it knows arrays, not grids.

The form is K2's (arXiv 2507.20534, section 2.3, Figure 5: validation loss against training FLOPs per sparsity,
a fitted line beneath) and Kimi Linear's (section 5.3: ``L = A * C^(-alpha)`` per arm, the FLOP ratio of two
arms read off the two fits at a target loss). The fitting recipe is Besiroglu et al. 2024 (arXiv 2404.10102,
their refit of Chinchilla's approach 3): the Huber loss (``delta = 1e-3``) of the residuals of *log* loss,
minimised by L-BFGS(-B) from a grid of starts, the best end point kept; intervals from refits on resampled
data. Here the resampling unit is the seed (a seed's cells share a trunk and a data order, so their noise is
not independent): :func:`seed_resamples` draws seeds with replacement, and a cell enters a refit with the
weight "how many times its seed was drawn", so a resample is a weight vector and the same resample can be
applied to every arm (paired comparisons).

Public API:

* :class:`PowerLaw` -- ``loss(C)`` and its inverse ``log_flops_at(L)``;
* :func:`fit_power_law(flops, loss, weights, irreducible, starts)` -> :class:`PowerLawFit` (parameters,
  Huber objective, convergence, log residuals);
* :func:`seed_resamples(seeds, n, rng_seed)` -> ``(n, len(seeds))`` multiplicities;
* :func:`percentile_interval(values, level)` -> ``(lo, hi)`` (the percentile bootstrap interval).

Why our own and not ``scipy.optimize.curve_fit`` / ``least_squares``: neither takes a Huber loss on the log of
a non-linear model with per-point weights *and* bounds from a grid of starts in one call; the objective is
six lines, the minimiser is scipy's.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize
from threadpoolctl import ThreadpoolController

__all__ = ["HUBER_DELTA", "PowerLaw", "PowerLawFit", "fit_power_law", "huber", "percentile_interval", "seed_resamples"]

#: Huber threshold on log-loss residuals (Besiroglu et al. 2024, section 3: delta = 1e-3, as Chinchilla's).
HUBER_DELTA = 1e-3
#: bounds of the exponent: 0 (a flat or rising arm sits on it and is reported as not converged) to 5
ALPHA_BOUNDS = (0.0, 5.0)
#: the starting exponents of the grid (a loss-vs-compute exponent is about 0.05 in Kaplan et al. 2020,
#: arXiv 2001.08361, eq. 1.4: alpha_C = 0.050; the starts span that and far beyond)
ALPHA_STARTS = (0.02, 0.1, 0.3, 1.0)
#: the starting irreducible terms, as fractions of the lowest fitted loss
E_START_FRACTIONS = (0.0, 0.5, 0.9)


_BLAS: ThreadpoolController | None = None


def _one_blas_thread():
    """A context that keeps the BLAS libraries on one thread. L-BFGS-B's few-by-few LAPACK calls wake
    OpenBLAS's thread pool at every iteration: measured on a 2-core Xeon under load, one 4-start fit
    took 0.62 s with the pool and 0.017 s on one thread. (The controller is made once, after scipy's
    BLAS is loaded: ``threadpoolctl`` only limits the libraries loaded when it looks.)"""
    global _BLAS
    if _BLAS is None:
        _BLAS = ThreadpoolController()
    return _BLAS.limit(limits=1, user_api="blas")


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    """Huber loss of residuals ``r`` (same shape): ``r^2 / 2`` within ``delta``, ``delta (|r| - delta / 2)``
    beyond."""
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


@dataclass(frozen=True)
class PowerLaw:
    """``L(C) = E + A * C^(-alpha)``, ``C`` in training FLOPs, ``L`` in nats; ``A`` kept as ``log_A`` (at
    ``C ~ 1e12-1e21`` and small exponents ``A`` itself is harmless, but its log is what the fit moves)."""

    log_A: float
    alpha: float
    E: float = 0.0

    @property
    def A(self) -> float:
        return math.exp(self.log_A)

    def loss(self, flops) -> np.ndarray:
        """Predicted loss (nats) at ``flops`` (array-like, > 0)."""
        return self.E + np.exp(self.log_A - self.alpha * np.log(np.asarray(flops, dtype=float)))

    def log_flops_at(self, loss: float) -> float:
        """``ln C`` at which the law reaches ``loss``; ``inf`` when it never does (``loss <= E`` or a flat
        law, ``alpha = 0``)."""
        if loss <= self.E or self.alpha <= 0:
            return math.inf
        return (self.log_A - math.log(loss - self.E)) / self.alpha


@dataclass(frozen=True)
class PowerLawFit:
    """One fit: the law, the (unscaled) weighted Huber objective at its end, convergence and the fit's data.

    ``converged``: a start whose L-BFGS-B run met a convergence test ended at the lowest objective found, and
    no parameter ended on a bound that makes the law degenerate (``alpha`` on either bound, ``E`` at the
    lowest loss). ``residuals``: ``ln L_obs -
    ln L_fit`` per point (the order of the input).
    """

    law: PowerLaw
    objective: float
    converged: bool
    message: str
    starts: int
    starts_succeeded: int
    residuals: tuple[float, ...] = field(default=())

    def as_dict(self) -> dict:
        return {
            "A": self.law.A,
            "log_A": self.law.log_A,
            "alpha": self.law.alpha,
            "E": self.law.E,
            "huber_objective": self.objective,
            "converged": self.converged,
            "message": self.message,
            "starts": self.starts,
            "starts_succeeded": self.starts_succeeded,
            "residuals_log": list(self.residuals),
        }


def _objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, w: np.ndarray, irreducible: bool):
    """Weighted Huber of log residuals, divided by ``delta^2`` (so that its scale is O(points): L-BFGS-B's
    relative stopping rule compares changes with max(|f|, 1), which an objective of 1e-7 would meet at
    once), and its gradient. ``theta`` = ``(a, alpha[, E])`` with ``ln(L - E) = a - alpha x`` and ``x`` the
    centred ``ln C``."""
    a, alpha = theta[0], theta[1]
    u = a - alpha * x
    if irreducible:
        e = theta[2]
        p = np.exp(u)
        pred = np.log(e + p)
        dpred = np.stack([p / (e + p), -x * p / (e + p), 1.0 / (e + p)])
    else:
        pred = u
        dpred = np.stack([np.ones_like(x), -x])
    r = y - pred
    psi = np.clip(r, -HUBER_DELTA, HUBER_DELTA)  # d huber / d r
    scale = 1.0 / HUBER_DELTA**2
    f = scale * float(np.sum(w * huber(r)))
    g = -scale * (dpred @ (w * psi))
    return f, g


def _grid_starts(y: np.ndarray, loss_min: float, irreducible: bool) -> list[tuple[float, ...]]:
    """The starting points: every ``alpha`` of :data:`ALPHA_STARTS` (with every ``E`` of
    :data:`E_START_FRACTIONS` when fitting one), ``a`` at the mean log loss above ``E``."""
    mean_loss = float(np.exp(np.mean(y)))
    if not irreducible:
        return [(float(np.mean(y)), al) for al in ALPHA_STARTS]
    return [
        (math.log(mean_loss - f * loss_min), al, f * loss_min)
        for al, f in itertools.product(ALPHA_STARTS, E_START_FRACTIONS)
    ]


def fit_power_law(
    flops, loss, weights=None, *, irreducible: bool = False, starts: list[PowerLaw] | None = None, grid: bool = True
) -> PowerLawFit:
    """Fit ``L = A * C^(-alpha)`` (``+ E`` with ``irreducible``) by minimising the weighted Huber loss of
    ``ln L_obs - ln L_fit`` with L-BFGS-B from a grid of starts (plus ``starts``, e.g. an earlier fit's law).

    Without ``E`` the problem is convex (a Huber loss of a function affine in ``(ln A, alpha)``): one start
    finds the optimum, so a bootstrap refit may pass the point estimate as its only start (``grid=False``).
    With ``E`` it is not, and the grid matters.

    Args:
        flops: ``(n,)`` training FLOPs of each point (> 0).
        loss: ``(n,)`` its loss (nats, > 0).
        weights: ``(n,)`` non-negative weights (a bootstrap's multiplicities); None = all 1.
        irreducible: also fit ``E`` in ``[0, min L)``.
        starts: extra starting laws (tried before the grid).
        grid: also start from the grid (:data:`ALPHA_STARTS` x :data:`E_START_FRACTIONS`); at least one of
            ``starts`` and ``grid`` is needed.

    Returns:
        :class:`PowerLawFit` of the start that ended lowest.

    Raises:
        ValueError: mismatched shapes, a non-positive or non-finite value, or fewer distinct FLOPs values
            with positive weight than parameters.
    """
    n_params = 3 if irreducible else 2
    c, L, w_fit = _fit_points(flops, loss, weights, n_params)
    x0 = float(np.average(np.log(c), weights=w_fit))  # centre ln C: the intercept is the loss at the centre
    x, y = np.log(c) - x0, np.log(L)
    loss_min = float(L.min())
    bounds = [(None, None), ALPHA_BOUNDS] + ([(0.0, loss_min * (1 - 1e-9))] if irreducible else [])
    thetas = [
        (law.log_A - law.alpha * x0, law.alpha) + ((min(law.E, loss_min * 0.99),) if irreducible else ())
        for law in (starts or [])
    ]
    if grid or not thetas:
        thetas += _grid_starts(y, loss_min, irreducible)
    results = _minimise_from(thetas, x, y, w_fit, irreducible, bounds)
    best = min(results, key=lambda r: r.fun)
    # Converged: a start that stopped by a convergence test reached the lowest objective (to 1e-9 of the
    # objective's O(points) scale). The lowest end point itself may be one whose line search stopped
    # ("ABNORMAL") a hair below, at the same parameters: the Huber kink makes that common at the optimum.
    tol = 1e-9 * max(1.0, abs(best.fun))
    at_best = [r for r in results if r.success and r.fun <= best.fun + tol]
    ok = sum(bool(r.success) for r in results)
    a, alpha = float(best.x[0]), float(best.x[1])
    e = float(best.x[2]) if irreducible else 0.0
    law = PowerLaw(log_A=a + alpha * x0, alpha=alpha, E=e)
    on_bound = (
        alpha <= ALPHA_BOUNDS[0] + 1e-9
        or alpha >= ALPHA_BOUNDS[1] - 1e-9
        or (irreducible and e >= loss_min * (1 - 1e-6))
    )
    message = str((at_best or [best])[0].message) + ("; a parameter ended on its bound" if on_bound else "")
    resid = np.log(np.asarray(loss, dtype=float)) - np.log(law.loss(np.asarray(flops, dtype=float)))
    return PowerLawFit(
        law=law,
        objective=float(best.fun) * HUBER_DELTA**2,
        converged=bool(at_best) and not on_bound,
        message=message,
        starts=len(thetas),
        starts_succeeded=ok,
        residuals=tuple(float(v) for v in resid),
    )


def _fit_points(flops, loss, weights, n_params: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The points a fit of ``n_params`` parameters uses, checked: ``(flops, loss, weights)`` of those with
    positive weight, each ``(m,)``. Raises ValueError as :func:`fit_power_law` says."""
    c, L = np.asarray(flops, dtype=float), np.asarray(loss, dtype=float)
    w = np.ones_like(c) if weights is None else np.asarray(weights, dtype=float)
    if not (c.shape == L.shape == w.shape and c.ndim == 1):
        raise ValueError(f"flops, loss and weights must be 1-D of one length; got {c.shape}, {L.shape}, {w.shape}")
    if not (np.all(np.isfinite(c) & (c > 0)) and np.all(np.isfinite(L) & (L > 0)) and np.all(w >= 0)):
        raise ValueError("flops and loss must be finite and > 0, weights >= 0")
    if len(np.unique(c[w > 0])) < n_params:
        raise ValueError(
            f"a fit of {n_params} parameters needs at least {n_params} distinct FLOPs values "
            f"with positive weight; got {len(np.unique(c[w > 0]))}"
        )
    keep = w > 0
    return c[keep], L[keep], w[keep]


def _minimise_from(thetas: list, x: np.ndarray, y: np.ndarray, w: np.ndarray, irreducible: bool, bounds: list) -> list:
    """scipy's L-BFGS-B run of :func:`_objective` from each start in ``thetas`` (on one BLAS thread); the runs
    that ended at a finite objective. Raises ValueError when none did."""
    with _one_blas_thread():
        results = [
            minimize(
                _objective,
                np.asarray(t0, dtype=float),
                args=(x, y, w, irreducible),
                jac=True,
                method="L-BFGS-B",
                bounds=bounds,
                options={"maxiter": 2000, "ftol": 1e-13, "gtol": 1e-9},
            )
            for t0 in thetas
        ]
    results = [r for r in results if np.isfinite(r.fun)]
    if not results:
        raise ValueError(f"every one of the {len(thetas)} starts of the fit ended at a non-finite objective")
    return results


def seed_resamples(n_seeds: int, n_resamples: int, rng_seed: int) -> np.ndarray:
    """``(n_resamples, n_seeds)`` int multiplicities: each row draws ``n_seeds`` seeds with replacement
    (``numpy.random.default_rng(rng_seed)``: the same rows for the same arguments, on every machine)."""
    rng = np.random.default_rng(rng_seed)
    draws = rng.integers(0, n_seeds, size=(n_resamples, n_seeds))
    return (
        np.stack([np.bincount(row, minlength=n_seeds) for row in draws])
        if n_resamples
        else np.zeros((0, n_seeds), dtype=int)
    )


def percentile_interval(values, level: float) -> tuple[float, float] | None:
    """The percentile bootstrap interval: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the
    finite ``values`` (numpy's default linear interpolation); None when there are fewer than 2."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if len(v) < 2:
        return None
    lo, hi = np.percentile(v, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)
