"""The records of a sparsity sweep's report (:mod:`k2.launcher.tools.sweep_report` writes them): the rows of
``sweep_cells.csv`` (:func:`cell_rows`, :data:`CSV_COLUMNS`), the whole of ``sweep.json`` (:func:`report_json`:
the grid, the options, the FLOP formula, the cells with their curves, the fits, the multipliers, the paired
differences, the leave-one-out check, the incomplete cells and the provisional reasons) and the training FLOPs
per token of each arm (:func:`per_token_flops`). Plain dicts, JSON-safe (NaN and inf as None). And how the
report's files are put in place, all or none: :func:`install_files` (:class:`ReportWriteError` names the
file and the cause where one cannot be written).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from k2.launcher.tools.sweep_analysis import Analysis, ArmFit, arm_label
from k2.launcher.tools.sweep_collect import GridData

__all__ = [
    "CSV_COLUMNS",
    "FLOP_FORMULA",
    "RENAME_ORDER",
    "ReportWriteError",
    "cell_rows",
    "install_files",
    "per_token_flops",
    "report_json",
]

FLOP_FORMULA = (
    "C = sum over a cell's training steps (the trunk's up to the branch point, then the branch's) of "
    "flops_per_token(cfg.model, seq_length).training x the step's tokens, each step at its own context length "
    "(k2.model.flops): training = 3 x forward; forward per token = MLA projections + causal core attention "
    "(s/2 keys per query) + dense SwiGLU FFNs + router 2 h E + the top-k routed experts + the shared expert "
    "+ LM head 2 h V, per MoE/dense layer; a [m,k]x[k,n] product counts 2mkn, element-wise work 0."
)

CSV_COLUMNS = (
    "cell",
    "arm",
    "sparsity",
    "experts",
    "size",
    "seed",
    "budget_tokens",
    "status",
    "tokens",
    "flops",
    "params_total",
    "params_active",
    "final_val_loss",
    "fit_residual_log",
    "wall_clock_s",
    "trunk_wall_clock_s",
    "tokens_per_s",
    "peak_rss_bytes",
    "load_median",
    "load_max",
    "collapsed",
    "in_fit",
    "problem",
)


def cell_rows(grid: GridData, analysis: Analysis) -> list[dict]:
    """One row per cell (:data:`CSV_COLUMNS`), grid.json's order; ``fit_residual_log``: ``ln L_obs - ln
    L_fit`` of a cell in its arm's fit."""
    resid: dict[str, float] = {}
    for af in analysis.arms.values():
        if af.fit is not None:
            resid |= {c.label: r for c, r in zip(af.cells, af.fit.residuals)}
    fitted = {c.label for af in analysis.arms.values() for c in af.cells}
    rows = []
    for c in grid.cells:
        s = c.spec
        rows.append(
            {
                "cell": s.cell,
                "arm": s.arm,
                "sparsity": s.sparsity,
                "experts": s.experts,
                "size": s.size,
                "seed": s.seed,
                "budget_tokens": s.budget_tokens,
                "status": c.status,
                "tokens": c.tokens,
                "flops": c.flops,
                "params_total": c.params_total,
                "params_active": c.params_active,
                "final_val_loss": c.final_val_loss,
                "fit_residual_log": resid.get(c.label),
                "wall_clock_s": c.wall_clock_s,
                "trunk_wall_clock_s": c.trunk_wall_clock_s,
                "tokens_per_s": c.tokens_per_s,
                "peak_rss_bytes": c.peak_rss_bytes,
                "load_median": c.load_median,
                "load_max": c.load_max,
                "collapsed": c.collapsed,
                "in_fit": c.label in fitted,
                "problem": c.problem,
            }
        )
    return rows


def _clean(v):
    """JSON-safe: NaN/inf -> None, tuples -> lists (``json`` would write NaN, which is not JSON)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


def _arm_json(af: ArmFit) -> dict:
    fit = af.fit.as_dict() if af.fit else None
    return {
        "arm": af.arm,
        "label": arm_label(af.arm, af.sparsity),
        "sparsity": af.sparsity,
        "experts": af.experts,
        "cells": [c.label for c in af.cells],
        "budgets": af.budgets,
        "loss_range": af.loss_range,
        "excluded": [{"cell": c, "why": w} for c, w in af.excluded],
        "fit": fit,
        "error": af.error,
        "intervals": af.intervals,
        "bootstrap_resamples": len(af.boot),
        "bootstrap_failed": sum(b is None for b in af.boot),
        "provisional": af.provisional,
    }


def per_token_flops(grid: GridData) -> dict[str, dict]:
    """Per arm, from its first cell read: training FLOPs per token at its last context length and the
    router's share of them (the one term that differs between arms of equal activated parameters)."""
    out = {}
    for c in grid.cells:
        if c.flops_per_token and c.spec.arm not in out:
            out[c.spec.arm] = {
                "seq_length": c.seq_length,
                "training_flops_per_token": c.flops_per_token,
                "router_share": c.router_share,
            }
    return out


def report_json(grid: GridData, analysis: Analysis) -> dict:
    """Everything the report holds, as one JSON-ready dict: ``sweep.json`` (the module docstring lists it)."""
    o, per_token = analysis.options, per_token_flops(grid)
    cells = cell_rows(grid, analysis)
    for row, c in zip(cells, grid.cells):
        row |= {"curve": c.curve, "branch_point": c.branch_point, "branch_step": c.spec.branch_step, "notes": c.notes}
    spec = grid.spec
    return _clean(
        {
            "grid": {
                "name": spec.name,
                "topk": spec.topk,
                "reference_arm": spec.reference_arm,
                "cooldown": spec.cooldown,
                "collapsed_load": spec.collapsed_load,
                "warmup_steps": spec.warmup_steps,
            },
            "options": {
                "reference": analysis.reference,
                "targets": list(o.targets) if o.targets else None,
                "irreducible": o.irreducible,
                "include_collapsed": o.include_collapsed,
                "n_bootstrap": o.n_bootstrap,
                "level": o.level,
                "rng_seed": o.rng_seed,
                "interval": "percentile, bootstrap over seeds (the same resample for every arm)",
            },
            "flop_formula": FLOP_FORMULA,
            "flops_per_token": per_token,
            "seeds": analysis.seeds,
            "cells": cells,
            "fits": {a: _arm_json(af) for a, af in analysis.arms.items()},
            "targets": analysis.targets,
            "targets_note": analysis.targets_note,
            "multipliers": analysis.multipliers,
            "paired_differences": analysis.paired,
            "leave_one_out": analysis.loo,
            "incomplete_cells": [{"cell": c.label, "status": c.status, "problem": c.problem} for c in grid.incomplete],
            "provisional": {"overall": bool(analysis.provisional), "reasons": analysis.provisional},
        }
    )


class ReportWriteError(Exception):
    """The report could not be written (a read-only directory, a full disk, ...): one line naming the file
    and the cause; none of the report's files was written or replaced."""


#: the outputs in the order they are renamed into place: ``sweep.md``, which links the figures, last
RENAME_ORDER = ("csv", "json", "loss_png", "multiplier_png", "md")


def _write_temporary(path: Path, data: bytes) -> None:
    """``data`` to ``path``, flushed to the disk (a full disk may only say so at the flush)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def install_files(paths: dict[str, Path], contents: dict[str, bytes]) -> None:
    """Every output to a temporary name beside it (``.<name>.tmp``), then, once all were written, each
    renamed into place (:data:`RENAME_ORDER`). On any failure the temporaries are removed, and so are the
    outputs of this run already renamed into place (a rename that fails after the others succeeded: a
    directory in the way): no set of files that looks like a complete report but is not.

    Raises:
        ReportWriteError: naming the file and the cause (e.g. "Read-only file system", "No space left on
            device").
    """
    temps = {k: p.with_name(f".{p.name}.tmp") for k, p in paths.items()}
    placed: list[Path] = []
    current = paths[RENAME_ORDER[0]]
    try:
        for k in RENAME_ORDER:
            current = paths[k]
            _write_temporary(temps[k], contents[k])
        for k in RENAME_ORDER:
            current = paths[k]
            os.replace(temps[k], paths[k])
            placed.append(paths[k])
    except OSError as e:
        removed = [p for p in placed if _remove(p)]
        raise ReportWriteError(
            f"{current}: cannot write it ({e.strerror or e}); the report was not written"
            + (f" (removed again: {', '.join(p.name for p in removed)})" if removed else "")
        ) from None
    finally:
        for tmp in temps.values():
            _remove(tmp)


def _remove(path: Path) -> bool:
    """Remove ``path`` if it is there; False where it was not or could not be removed (a read-only
    directory: then no temporary was written there either)."""
    try:
        path.unlink()
        return True
    except OSError:
        return False
