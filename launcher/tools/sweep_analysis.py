"""The sparsity sweep's analysis for ``k2-sweep-report``: per-arm fits with bootstrap intervals, compute
multipliers at target losses, paired loss differences, a leave-one-out check, and the "provisional" flags.

Method (the sources are in :mod:`k2.launcher.tools.sweep_fit`):

* **fit**: per arm, ``L = A * C^(-alpha)`` (``+ E`` with ``irreducible``) on (training FLOPs, final
  validation loss) of its finished cells, every seed and size pooled; collapsed cells (median expert load
  after warm-up above ``grid.json``'s ``collapsed_load``) left out unless ``include_collapsed``.
* **bootstrap** over seeds: ``n_bootstrap`` resamples of the seeds with replacement (one RNG seed: the same
  resamples on every run); every arm is refitted on the *same* resample, so a comparison of two arms is
  paired. Intervals are percentile intervals at ``level`` (default 95%). With few seeds they are too
  narrow (a bootstrap over 2-4 clusters cannot see how uncertain its own spread is): on synthetic grids of
  4 seeds a 95% interval held the true value in about 80-85% of draws
  (``tests/unit/launcher/tools/test_sweep_analysis.py::test_interval_coverage_on_synthetic_grids``).
* **multiplier** of an arm against a baseline arm at a target loss ``L*``: ``C_base(L*) / C_arm(L*)``, the
  two fits' FLOPs read at the *same loss* (Kimi Linear section 5.3; not the FLOPs of the two arms at the same
  step, the mistake of marin issue #4716). > 1: the arm reaches ``L*`` with fewer FLOPs. With unequal
  exponents it depends on ``L*``, so it is reported at each target: by default 3 losses evenly inside the
  overlap of the arms' measured final losses (1/4, 1/2, 3/4 of it), so no multiplier is an extrapolation.
* **paired difference** at each budget: arm minus baseline final loss per seed (the same data order and
  evaluation tokens), their mean and standard error over seeds (``stdev / sqrt(n)``).
* **leave-one-out**: each arm refitted without its largest budget, which it then predicts.

Public API: :class:`ReportOptions`; :func:`fit_arms(grid, options) <fit_arms>` -> ``{arm: ArmFit}``;
:func:`analyze(grid, options) <analyze>` -> :class:`Analysis` (all of the above); :func:`sign_phrase` (an
arm's multipliers in one phrase) and :func:`no_interval_reason`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from k2.launcher.tools.sweep_collect import Cell, GridData
from k2.launcher.tools.sweep_fit import PowerLaw, PowerLawFit, fit_power_law, percentile_interval, seed_resamples

__all__ = [
    "Analysis",
    "ArmFit",
    "ReportOptions",
    "analyze",
    "arm_label",
    "fit_arms",
    "no_interval_reason",
    "sign_phrase",
]

#: where inside the overlap of the arms' loss ranges the automatic targets sit (fractions from its bottom)
TARGET_FRACTIONS = (0.25, 0.5, 0.75)
#: fewer distinct budgets than this in an arm's fit make it provisional
MIN_BUDGETS = 3


@dataclass(frozen=True)
class ReportOptions:
    """The report's settings (``k2-sweep-report``'s flags). ``reference``: the baseline arm (default
    grid.json's ``reference_arm``); ``targets``: losses (nats) for the multipliers (default: automatic)."""

    reference: str | None = None
    targets: tuple[float, ...] | None = None
    irreducible: bool = False
    include_collapsed: bool = False
    n_bootstrap: int = 1000
    level: float = 0.95
    rng_seed: int = 0


@dataclass
class ArmFit:
    """One arm: the fitted cells, the point fit (None when it could not be made: ``error``), one law per
    bootstrap resample (None where a resample could not be fitted), intervals and provisional reasons."""

    arm: str
    sparsity: int
    experts: int
    cells: list[Cell]
    excluded: list[tuple[str, str]] = field(default_factory=list)
    fit: PowerLawFit | None = None
    error: str | None = None
    boot: list[PowerLaw | None] = field(default_factory=list)
    intervals: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    provisional: list[str] = field(default_factory=list)

    @property
    def budgets(self) -> int:
        """Distinct compute points (size, budget) in the fit."""
        return len({(c.spec.size, c.spec.budget_tokens) for c in self.cells})

    @property
    def loss_range(self) -> tuple[float, float] | None:
        losses = [c.final_val_loss for c in self.cells]
        return (min(losses), max(losses)) if losses else None


@dataclass
class Analysis:
    """Everything the report prints: ``arms`` by sparsity; ``multipliers`` and ``paired`` per baseline
    (``reference`` and ``lowest``: the lowest sparsity above 1, when it is another arm and an arm lies above
    it; else None); ``seeds``: the seeds with a finished cell; ``provisional``: overall reasons (empty =
    final)."""

    options: ReportOptions
    reference: str
    lowest: str | None
    seeds: list[int]
    targets: list[float]
    targets_note: str
    arms: dict[str, ArmFit]
    multipliers: dict[str, list[dict]]
    paired: dict[str, list[dict]]
    loo: list[dict]
    provisional: list[str]


def arm_label(arm: str, sparsity: int) -> str:
    """``dense (sparsity 1)`` for the dense arm (every expert active: experts = top-k), the arm's name
    otherwise."""
    return "dense (sparsity 1)" if sparsity == 1 else arm


def _fit_cells(grid: GridData, arm: str, opts: ReportOptions) -> tuple[list[Cell], list[tuple[str, str]]]:
    fitted, excluded = [], []
    for c in grid.cells_of(arm, "finished"):
        if c.collapsed and not opts.include_collapsed:
            excluded.append(
                (
                    c.label,
                    f"collapsed: median expert load {c.load_median:.2f} > {grid.spec.collapsed_load:g} after warm-up",
                )
            )
        else:
            fitted.append(c)
    return fitted, excluded


def _bootstrap(af: ArmFit, seeds: list[int], counts: np.ndarray, irreducible: bool) -> list[PowerLaw | None]:
    """One refit per resample row (weights = the multiplicity of each cell's seed); rows giving the arm the
    same weights share one fit (few seeds: few distinct resamples)."""
    idx = [seeds.index(c.spec.seed) for c in af.cells]
    flops = [c.flops for c in af.cells]
    loss = [c.final_val_loss for c in af.cells]
    cache: dict[tuple, PowerLaw | None] = {}
    out = []
    for row in counts:
        w = tuple(int(row[i]) for i in idx)
        if w not in cache:
            try:
                cache[w] = fit_power_law(
                    flops, loss, w, irreducible=irreducible, starts=[af.fit.law], grid=irreducible
                ).law
            except ValueError:  # this resample leaves the arm too few budgets to fit
                cache[w] = None
        out.append(cache[w])
    return out


def _arm_provisional(af: ArmFit, grid: GridData, n_seeds: int) -> list[str]:
    why = []
    if af.fit is None:
        why.append(f"no fit: {af.error}")
    elif not af.fit.converged:
        why.append(f"fit did not converge ({af.fit.message})")
    missing = [c for c in grid.cells_of(af.arm) if c.status != "finished"]
    if missing:
        why.append(f"{len(missing)} cell(s) missing, unfinished or unreadable")
    if af.budgets < MIN_BUDGETS:
        why.append(f"{af.budgets} budget(s) in the fit (fewer than {MIN_BUDGETS})")
    if af.excluded:
        why.append(f"{len(af.excluded)} collapsed cell(s) excluded")
    if n_seeds < 2:
        why.append("one seed: no bootstrap interval")
    failed = sum(b is None for b in af.boot)
    if failed:
        why.append(f"{failed} of {len(af.boot)} bootstrap resamples could not be fitted")
    return why


def fit_arms(grid: GridData, opts: ReportOptions) -> tuple[dict[str, ArmFit], list[int]]:
    """The point fit, the bootstrap refits, the intervals and the provisional reasons of every arm.

    Returns:
        ``({arm: ArmFit}`` in order of sparsity, the seeds the bootstrap resamples``)``.
    """
    arms: dict[str, ArmFit] = {}
    for arm in grid.spec.arms:
        spec = next(c.spec for c in grid.cells if c.spec.arm == arm)
        cells, excluded = _fit_cells(grid, arm, opts)
        af = ArmFit(arm, spec.sparsity, spec.experts, cells, excluded)
        try:
            af.fit = fit_power_law(
                [c.flops for c in cells], [c.final_val_loss for c in cells], irreducible=opts.irreducible
            )
        except ValueError as e:
            af.error = str(e)
        arms[arm] = af
    seeds = sorted({c.spec.seed for af in arms.values() if af.fit for c in af.cells})
    counts = seed_resamples(len(seeds), opts.n_bootstrap if len(seeds) > 1 else 0, opts.rng_seed)
    for af in arms.values():
        if af.fit is not None:
            af.boot = _bootstrap(af, seeds, counts, opts.irreducible)
            for name in ("alpha", "A") + (("E",) if opts.irreducible else ()):
                af.intervals[name] = percentile_interval([getattr(b, name) for b in af.boot if b], opts.level)
        af.provisional = _arm_provisional(af, grid, len(seeds))
    return arms, seeds


def choose_targets(arms: dict[str, ArmFit], given: tuple[float, ...] | None) -> tuple[list[float], str]:
    """The target losses and how they were chosen: ``given``, or :data:`TARGET_FRACTIONS` of the overlap of
    the fitted arms' final-loss ranges, rounded to 3 decimals (4 where 3 would merge two)."""
    if given:
        return sorted(given, reverse=True), "given (--targets)"
    ranges = [af.loss_range for af in arms.values() if af.fit is not None]
    if len(ranges) < 2:
        return [], "fewer than two arms have a fit: no comparison"
    lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
    if lo >= hi:
        return [], (
            f"the arms' final-loss ranges do not overlap (highest minimum {lo:.4f} >= lowest maximum "
            f"{hi:.4f}): no target inside every arm's data; give --targets to extrapolate"
        )
    raw = [hi - f * (hi - lo) for f in TARGET_FRACTIONS]
    for digits in (3, 4, 6):
        targets = [round(t, digits) for t in raw]
        if len(set(targets)) == len(targets) and all(lo < t < hi for t in targets):
            break
    return targets, (
        f"{', '.join(f'{f:g}' for f in TARGET_FRACTIONS)} of the way down the overlap of the arms' "
        f"final losses, [{lo:.4f}, {hi:.4f}]"
    )


def _ratio(base: PowerLaw | None, arm: PowerLaw | None, target: float) -> float:
    if base is None or arm is None:
        return math.nan
    d = base.log_flops_at(target) - arm.log_flops_at(target)
    return math.exp(d) if math.isfinite(d) else math.nan


def multipliers(
    arms: dict[str, ArmFit], base: str, others: list[str], targets: list[float], level: float
) -> list[dict]:
    """Per arm of ``others`` and per target: the multiplier ``C_base(L*) / C_arm(L*)``, its paired bootstrap
    interval (the same resample for both arms) and whether ``L*`` lies inside both arms' data."""
    b = arms[base]
    rows = []
    for af in (arms[a] for a in others):
        if af.fit is None or b.fit is None:
            continue
        for t in targets:
            boot = [_ratio(x, y, t) for x, y in zip(b.boot, af.boot)]
            inside = all(r is not None and r[0] <= t <= r[1] for r in (b.loss_range, af.loss_range))
            rows.append(
                {
                    "arm": af.arm,
                    "sparsity": af.sparsity,
                    "baseline": base,
                    "target_loss": t,
                    "multiplier": _ratio(b.fit.law, af.fit.law, t),
                    "interval": percentile_interval(boot, level),
                    "resamples": sum(math.isfinite(v) for v in boot),
                    "inside_data": inside,
                }
            )
    return rows


def paired_differences(grid: GridData, base: str, others: list[str]) -> list[dict]:
    """Per arm of ``others`` and per (size, budget): the final loss of the arm minus the baseline's on each
    seed both finished, the mean, and the standard error over seeds (None with one seed)."""

    def by_key(arm):
        return {(c.spec.size, c.spec.budget_tokens, c.spec.seed): c for c in grid.cells_of(arm, "finished")}

    ref = by_key(base)
    rows = []
    for arm in others:
        mine = by_key(arm)
        for size, budget in sorted({k[:2] for k in mine}, key=lambda k: (str(k[0]), k[1])):
            seeds = sorted(s for (z, bt, s) in mine if (z, bt) == (size, budget) and (z, bt, s) in ref)
            diffs = [mine[(size, budget, s)].final_val_loss - ref[(size, budget, s)].final_val_loss for s in seeds]
            collapsed = any(bool(x.collapsed) for s in seeds for x in (mine[(size, budget, s)], ref[(size, budget, s)]))
            rows.append(
                {
                    "arm": arm,
                    "baseline": base,
                    "size": size,
                    "budget_tokens": budget,
                    "seeds": seeds,
                    "differences": diffs,
                    "mean": statistics.fmean(diffs) if diffs else None,
                    "stderr": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None,
                    "collapsed_cell": collapsed,
                }
            )
    return rows


def leave_one_out(af: ArmFit, irreducible: bool) -> dict:
    """The arm refitted without its largest budget (the compute point of the highest mean FLOPs), which the
    refit predicts at the mean FLOPs of its cells; ``error`` = predicted - observed mean loss (nats)."""
    points: dict[tuple, list[Cell]] = {}
    for c in af.cells:
        points.setdefault((c.spec.size, c.spec.budget_tokens), []).append(c)
    out = {"arm": af.arm}
    if len(points) < 2:
        return out | {"error": None, "note": "fewer than two budgets"}
    key = max(points, key=lambda k: statistics.fmean(c.flops for c in points[k]))
    held, rest = points[key], [c for k, cs in points.items() if k != key for c in cs]
    out |= {
        "held_out_budget_tokens": key[1],
        "held_out_size": key[0],
        "flops": statistics.fmean(c.flops for c in held),
        "observed": statistics.fmean(c.final_val_loss for c in held),
    }
    try:
        fit = fit_power_law([c.flops for c in rest], [c.final_val_loss for c in rest], irreducible=irreducible)
    except ValueError as e:
        return out | {"error": None, "note": f"refit impossible: {e}"}
    pred = float(fit.law.loss(out["flops"]))
    return out | {
        "predicted": pred,
        "error": pred - out["observed"],
        "relative_error": pred / out["observed"] - 1,
        "converged": fit.converged,
        "note": "",
    }


def _lowest_sparsity(arms: dict[str, ArmFit], reference: str) -> str | None:
    above = [af for af in arms.values() if af.sparsity > 1]
    if not above:
        return None
    low = min(above, key=lambda af: af.sparsity).arm
    return None if low == reference else low


def analyze(grid: GridData, opts: ReportOptions) -> Analysis:
    """Fits, targets, multipliers and paired differences against the reference arm and against the lowest
    sparsity above 1, leave-one-out, provisional flags (see the module docstring)."""
    ref = opts.reference or grid.spec.reference_arm
    arms, _ = fit_arms(grid, opts)
    targets, note = choose_targets(arms, opts.targets)
    lowest = _lowest_sparsity(arms, ref)
    # against the reference: every other arm; against the lowest sparsity: the arms above it, if any
    others = {ref: [a for a in arms if a != ref]}
    above = [a for a in arms if lowest and arms[a].sparsity > arms[lowest].sparsity]
    if above:
        others[lowest] = above
    else:
        lowest = None
    mult = {b: multipliers(arms, b, o, targets, opts.level) for b, o in others.items()}
    paired = {b: paired_differences(grid, b, o) for b, o in others.items()}
    loo = [leave_one_out(af, opts.irreducible) for af in arms.values() if af.cells]
    why = [f"{af.arm}: {w}" for af in arms.values() for w in af.provisional]
    if not targets:
        why.append(f"no target loss: {note}")
    if any(not r["inside_data"] for rows in mult.values() for r in rows):
        why.append("a target lies outside an arm's measured losses (the multiplier there is an extrapolation)")
    if arms[ref].fit is None:
        why.append(f"the reference arm {ref} has no fit")
    return Analysis(
        options=opts,
        reference=ref,
        lowest=lowest,
        seeds=sorted({c.spec.seed for c in grid.cells if c.status == "finished"}),
        targets=targets,
        targets_note=note,
        arms=arms,
        multipliers=mult,
        paired=paired,
        loo=loo,
        provisional=why,
    )


def no_interval_reason(analysis: Analysis) -> str:
    """Why the multipliers have no interval (one seed, ``--bootstrap 0``, no resample fitted)."""
    if len(analysis.seeds) < 2:
        return "no intervals: one seed"
    if analysis.options.n_bootstrap == 0:
        return "no intervals: --bootstrap 0"
    return "no intervals: no bootstrap resample could be fitted"


def _resolution(ivs: list, beyond, side: str, none_why: str) -> str:
    if all(iv is None for iv in ivs):
        return f" ({none_why})"
    if all(iv and beyond(iv) for iv in ivs):
        return f", every interval {side} 1"
    if any(iv is None for iv in ivs):
        return " (not resolved: a target has no interval)"
    return " (not resolved: an interval reaches 1)"


def sign_phrase(rows: list[dict], none_why: str) -> str:
    """One phrase for an arm's multipliers (rows of :func:`multipliers`) over the targets against one
    baseline: "fewer FLOPs at every target, every interval above 1" (resolved), "... (not resolved: an
    interval reaches 1)", "mixed: ..." naming the targets on each side; ``none_why`` is said where there are
    no intervals at all (:func:`no_interval_reason`)."""
    ms = [r["multiplier"] for r in rows if math.isfinite(r["multiplier"])]
    if not ms:
        return "no multiplier"
    ivs = [r["interval"] for r in rows]
    if all(m > 1 for m in ms):
        return "fewer FLOPs at every target" + _resolution(ivs, lambda iv: iv[0] > 1, "above", none_why)
    if all(m < 1 for m in ms):
        return "more FLOPs at every target" + _resolution(ivs, lambda iv: iv[1] < 1, "below", none_why)
    fewer = [f"{r['target_loss']:g}" for r in rows if r["multiplier"] > 1]
    more = [f"{r['target_loss']:g}" for r in rows if r["multiplier"] < 1]
    return f"mixed: fewer FLOPs at L* = {', '.join(fewer)}; more at L* = {', '.join(more)}"
