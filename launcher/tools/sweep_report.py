"""``k2-sweep-report SWEEP_DIR``: the report of a sparsity sweep grid (arms x sizes x seeds x budgets, each
budget a WSD cooldown branch of its trunk): per-arm fits with intervals, compute multipliers against the
reference arm at target losses, paired loss differences, a leave-one-out check and "provisional" flags.

Outputs (in SWEEP_DIR or ``--out``; all five are built in memory, written to temporary names, and renamed
into place only once every one was written, so a killed or failed report never leaves files that look
complete; a read-only directory or a full disk is one error line naming the file and the cause):

* ``sweep_cells.csv``: one row per cell (arm, sparsity, experts, seed, budget, tokens, training FLOPs,
  parameters total/active, final validation loss, fit residual, wall-clock, tokens/s, peak memory, expert
  load, collapsed, in the fit, and the problem of a missing/unfinished/unreadable cell naming its file);
* ``sweep.md``: the FLOP formula, the cells, the fits, the multipliers, the paired differences, the
  leave-one-out check, the provisional reasons and the incomplete cells;
* ``sweep.json``: all of it, machine-readable; the same inputs give the same bytes (fixed bootstrap seed, no
  time stamps, paths relative to SWEEP_DIR);
* ``sweep_loss_vs_flops.png`` and ``sweep_multiplier.png`` (:mod:`k2.launcher.tools.sweep_plots`).

Public API: :func:`report_main(argv) <report_main>` -> exit status; :func:`write_report(grid, analysis,
out_dir) <write_report>` -> ``{kind: path}`` (:class:`ReportWriteError`); :func:`render_report` -> the
outputs' bytes; :func:`summary_lines`; :func:`markdown`; the pieces are
:func:`k2.launcher.tools.sweep_collect.collect_grid`, :func:`k2.launcher.tools.sweep_analysis.analyze` and the
CSV rows and JSON document of :mod:`k2.launcher.tools.sweep_records`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from k2.launcher.tools.sweep_analysis import (
    Analysis,
    ReportOptions,
    analyze,
    arm_label,
    no_interval_reason,
    sign_phrase,
)
from k2.launcher.tools.sweep_collect import GridData, SweepInputError, collect_grid, read_grid_spec
from k2.launcher.tools.sweep_records import (
    CSV_COLUMNS,
    FLOP_FORMULA,
    ReportWriteError,
    cell_rows,
    install_files,
    per_token_flops,
    report_json,
)

__all__ = ["ReportWriteError", "markdown", "render_report", "report_main", "summary_lines", "write_report"]

#: what the intervals are worth with few seeds, as measured by the slow test
#: tests/unit/launcher/tools/test_sweep_analysis.py::test_interval_coverage_on_synthetic_grids
INTERVAL_CAVEAT = (
    "With few seeds these intervals are too narrow: on synthetic grids of 4 seeds (40 draws) a 95% "
    "interval held the true alpha in 85% of draws and the true multiplier in 79%; fewer seeds do worse "
    "(2 seeds give 3 distinct resamples)."
)


def _f(v, spec: str = "", none: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def _iv(iv, spec: str = ".4f") -> str:
    return f"[{_f(iv[0], spec)}, {_f(iv[1], spec)}]" if iv else "-"


def _table(head: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _md_cells(rows: list[dict]) -> list[str]:
    head = (
        "cell",
        "sparsity",
        "experts",
        "seed",
        "budget tokens",
        "status",
        "tokens",
        "training FLOPs",
        "params total / active",
        "final val loss",
        "fit residual (ln)",
        "wall-clock s (trunk s)",
        "tokens/s",
        "peak RSS MiB",
        "expert load median / max",
        "collapsed",
        "in fit",
    )
    body = [
        (
            r["cell"],
            str(r["sparsity"]),
            str(r["experts"]),
            str(r["seed"]),
            f"{r['budget_tokens']:,}",
            r["status"],
            _f(r["tokens"], ","),
            _f(r["flops"], ".4e"),
            f"{_f(r['params_total'], ',')} / {_f(r['params_active'], ',')}",
            _f(r["final_val_loss"], ".4f"),
            _f(r["fit_residual_log"], "+.4f"),
            f"{_f(r['wall_clock_s'], '.0f')} ({_f(r['trunk_wall_clock_s'], '.0f')})",
            _f(r["tokens_per_s"], ",.0f"),
            _f(r["peak_rss_bytes"] and r["peak_rss_bytes"] / 2**20, ",.0f"),
            f"{_f(r['load_median'], '.2f')} / {_f(r['load_max'], '.2f')}",
            {True: "**yes**", False: "no", None: "-"}[r["collapsed"]],
            "yes" if r["in_fit"] else "no",
        )
        for r in rows
    ]
    return _table(head, body)


def _md_fits(analysis: Analysis) -> list[str]:
    pct = f"{analysis.options.level:.0%}"
    head = ["arm", "cells (budgets)", "alpha", f"alpha {pct}", "A", f"A {pct}"]
    head += ["E", f"E {pct}"] if analysis.options.irreducible else []
    head += ["rms residual (ln)", "max abs residual (ln)", "converged", "provisional"]
    body = []
    for af in analysis.arms.values():
        if af.fit is None:
            body.append(
                [arm_label(af.arm, af.sparsity), f"{len(af.cells)} ({af.budgets})"]
                + ["-"] * (len(head) - 3)
                + ["; ".join(af.provisional)]
            )
            continue
        law, res = af.fit.law, af.fit.residuals
        row = [
            arm_label(af.arm, af.sparsity),
            f"{len(af.cells)} ({af.budgets})",
            f"{law.alpha:.4f}",
            _iv(af.intervals.get("alpha")),
            f"{law.A:.4g}",
            _iv(af.intervals.get("A"), ".4g"),
        ]
        if analysis.options.irreducible:
            row += [f"{law.E:.4f}", _iv(af.intervals.get("E"))]
        row += [
            f"{math.sqrt(sum(r * r for r in res) / len(res)):.4f}",
            f"{max(abs(r) for r in res):.4f}",
            "yes" if af.fit.converged else f"**no** ({af.fit.message})",
            "; ".join(af.provisional) or "no",
        ]
        body.append(row)
    return _table(head, body)


def _md_comparisons(analysis: Analysis) -> list[str]:
    pct = f"{analysis.options.level:.0%}"
    lines = []
    for base, rows in analysis.multipliers.items():
        b = analysis.arms[base]
        lines += [
            "",
            f"### Against {arm_label(base, b.sparsity)}",
            "",
            f"Compute multiplier C_{base}(L*) / C_arm(L*) (> 1: the arm needs fewer FLOPs to reach L*), "
            f"{pct} interval:",
            "",
        ]
        lines += _table(
            ("arm", "L*", "multiplier", f"{pct} interval", "resamples", "L* inside both arms' data"),
            [
                (
                    r["arm"],
                    f"{r['target_loss']:g}",
                    _f(r["multiplier"], ".3f") + "x",
                    _iv(r["interval"], ".3f"),
                    str(r["resamples"]),
                    "yes" if r["inside_data"] else "**no**",
                )
                for r in rows
            ],
        )
        why = no_interval_reason(analysis)
        lines += [""] + [
            f"- {arm}: {sign_phrase([r for r in rows if r['arm'] == arm], why)}"
            for arm in dict.fromkeys(r["arm"] for r in rows)
        ]
        lines += ["", "Paired final-loss difference, arm minus baseline, per seed (nats):", ""]
        lines += _table(
            ("arm", "size", "budget tokens", "seeds", "differences", "mean", "std. error"),
            [
                (
                    r["arm"],
                    str(r["size"] or "-"),
                    f"{r['budget_tokens']:,}",
                    str(r["seeds"]),
                    ", ".join(f"{d:+.4f}" for d in r["differences"]) or "-",
                    _f(r["mean"], "+.4f"),
                    _f(r["stderr"], ".4f"),
                )
                for r in analysis.paired[base]
            ],
        )
    return lines


def markdown(grid: GridData, analysis: Analysis) -> str:
    """``sweep.md``'s text."""
    o, n_fin = analysis.options, sum(c.status == "finished" for c in grid.cells)
    prov = "**provisional**" if analysis.provisional else "final (no provisional reason)"
    lines = [
        f"# Sparsity sweep `{grid.spec.name}`",
        "",
        f"{n_fin} of {len(grid.cells)} cells finished; seeds {analysis.seeds}; reference arm "
        f"{arm_label(analysis.reference, analysis.arms[analysis.reference].sparsity)}; this report is {prov}.",
        "",
        "![loss vs FLOPs](sweep_loss_vs_flops.png) ![multiplier](sweep_multiplier.png)",
        "",
        "## Method",
        "",
        f"Training FLOPs: {FLOP_FORMULA}",
        "",
        f"Fit per arm: L = A * C^(-alpha){' + E' if o.irreducible else ''} on (training FLOPs, final "
        "validation loss) of the finished cells, seeds pooled; Huber loss (delta 1e-3) of ln-loss residuals, "
        "L-BFGS-B from a grid of starts (Besiroglu et al. 2024, arXiv 2404.10102). Intervals: "
        f"{o.level:.0%} percentile intervals of {o.n_bootstrap} bootstrap resamples of the seeds (RNG seed "
        f"{o.rng_seed}; every arm refitted on the same resample). {INTERVAL_CAVEAT} Collapsed cells (median "
        f"moe_load_max_over_mean after step {grid.spec.warmup_steps} above {grid.spec.collapsed_load:g}) are "
        + ("included." if o.include_collapsed else "left out.")
        + f" Targets: {analysis.targets_note}.",
        "",
    ]
    lines += _table(
        ("arm", "context length", "training FLOPs per token", "router share"),
        [
            (arm, str(v["seq_length"]), f"{v['training_flops_per_token']:.4e}", f"{v['router_share']:.2%}")
            for arm, v in per_token_flops(grid).items()
        ],
    )
    lines += ["", "## Cells", ""] + _md_cells(cell_rows(grid, analysis))
    lines += ["", "## Fits", ""] + _md_fits(analysis)
    lines += ["", "## Comparisons"] + _md_comparisons(analysis)
    lines += ["", "## Leave-one-out (each arm refitted without its largest budget, which it predicts)", ""]
    lines += _table(
        ("arm", "held-out budget tokens", "observed", "predicted", "error (nats)", "note"),
        [
            (
                r["arm"],
                _f(r.get("held_out_budget_tokens"), ","),
                _f(r.get("observed"), ".4f"),
                _f(r.get("predicted"), ".4f"),
                _f(r.get("error"), "+.4f"),
                r.get("note", ""),
            )
            for r in analysis.loo
        ],
    )
    lines += ["", "## Provisional", ""] + ([f"- {w}" for w in analysis.provisional] or ["- none"])
    lines += ["", "## Missing, unfinished or unreadable cells", ""]
    lines += [f"- {c.label}: {c.status}: {c.problem}" for c in grid.incomplete] or ["- none"]
    notes = [n for c in grid.cells for n in c.notes]
    lines += (["", "## Notes", ""] + [f"- {n}" for n in notes]) if notes else []
    return "\n".join(lines) + "\n"


def summary_lines(grid: GridData, analysis: Analysis) -> list[str]:
    """The short stdout summary: alphas, multipliers, signs against dense/reference and the lowest sparsity,
    the provisional flag."""
    pct, n_fin = f"{analysis.options.level:.0%}", sum(c.status == "finished" for c in grid.cells)
    out = [f"sweep {grid.spec.name}: {n_fin} of {len(grid.cells)} cells finished, seeds {analysis.seeds}"]
    out += [f"  {c.label}: {c.status}: {c.problem}" for c in grid.incomplete]
    out.append(
        f"fits L = A * C^(-alpha){' + E' if analysis.options.irreducible else ''} ({pct} seed-bootstrap intervals):"
    )
    for af in analysis.arms.values():
        alpha = f"alpha {af.fit.law.alpha:.4f} {_iv(af.intervals.get('alpha'))}" if af.fit else f"no fit ({af.error})"
        out.append(
            f"  {arm_label(af.arm, af.sparsity)}: {alpha}"
            + (f" PROVISIONAL ({'; '.join(af.provisional)})" if af.provisional else "")
        )
    why = no_interval_reason(analysis)
    for base, rows in analysis.multipliers.items():
        label = arm_label(base, analysis.arms[base].sparsity)
        out.append(f"multipliers C_base(L*) / C_arm(L*) against {label} (> 1: fewer FLOPs):")
        for t in analysis.targets:
            at = [
                f"{r['arm']} {_f(r['multiplier'], '.3f')}x {_iv(r['interval'], '.3f')}"
                + ("" if r["inside_data"] else " (extrapolated: outside an arm's losses)")
                for r in rows
                if r["target_loss"] == t
            ]
            out.append(f"  L* = {t:g}: " + "; ".join(at))
        for arm in dict.fromkeys(r["arm"] for r in rows):
            out.append(f"  sign: {arm} vs {label}: {sign_phrase([r for r in rows if r['arm'] == arm], why)}")
    out.append(
        "provisional: "
        + (f"yes ({len(analysis.provisional)} reason(s), listed in sweep.md)" if analysis.provisional else "no")
    )
    return out


def render_report(grid: GridData, analysis: Analysis) -> dict[str, bytes]:
    """The five outputs' bytes (module docstring), figures included, built in memory: ``{csv, md, json,
    loss_png, multiplier_png}`` -> bytes. Nothing is written."""
    from k2.launcher.tools.sweep_plots import plot_loss_vs_flops, plot_multipliers

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in cell_rows(grid, analysis))
    figures = {"loss_png": io.BytesIO(), "multiplier_png": io.BytesIO()}
    plot_loss_vs_flops(grid, analysis, figures["loss_png"])
    plot_multipliers(analysis, figures["multiplier_png"])
    return {
        "csv": buf.getvalue().encode(),
        "md": markdown(grid, analysis).encode(),
        "json": (json.dumps(report_json(grid, analysis), indent=1, sort_keys=True) + "\n").encode(),
        "loss_png": figures["loss_png"].getvalue(),
        "multiplier_png": figures["multiplier_png"].getvalue(),
    }


def write_report(grid: GridData, analysis: Analysis, out_dir) -> dict[str, str]:
    """Write the five outputs (module docstring) into ``out_dir``, all or none
    (:func:`~k2.launcher.tools.sweep_records.install_files`). Returns ``{csv, md, json, loss_png,
    multiplier_png}`` -> path.

    Raises:
        ReportWriteError: an output could not be written (the file and the cause named).
    """
    out = Path(out_dir)
    paths = {
        "csv": out / "sweep_cells.csv",
        "md": out / "sweep.md",
        "json": out / "sweep.json",
        "loss_png": out / "sweep_loss_vs_flops.png",
        "multiplier_png": out / "sweep_multiplier.png",
    }
    install_files(paths, render_report(grid, analysis))
    return {k: str(v) for k, v in paths.items()}


class _UsageError(Exception):
    """A bad argument: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own prints the usage too; the brief error line is the contract
        raise _UsageError(message)


def _targets(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected comma-separated losses, e.g. 3.4,3.3") from None
    if not all(math.isfinite(v) and v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"'{text}': every target loss must be a finite number > 0")
    return vals


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}': expected an integer >= 0")
    return int(text)


def _level(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"'{text}': expected a number in (0, 1), e.g. 0.95")
    return v


def _parser() -> _Parser:
    p = _Parser(
        prog="k2-sweep-report",
        description=(
            "Report a sparsity sweep grid (SWEEP_DIR/grid.json and its cells): per-arm fits L = A * C^(-alpha) with "
            "seed-bootstrap intervals, compute multipliers against the reference arm at target losses, paired loss "
            "differences, a leave-one-out check, provisional flags. Writes sweep_cells.csv, sweep.md, sweep.json, "
            "sweep_loss_vs_flops.png and sweep_multiplier.png. Exit status: 0 done (a partial grid too: its missing "
            "cells are named), 1 an output could not be written (the file and the cause named; no report file left "
            "behind), 2 a bad argument or no grid.json / no readable cell."
        ),
    )
    p.add_argument("sweep_dir", metavar="SWEEP_DIR")
    p.add_argument("--out", metavar="DIR", help="write the outputs here (default: SWEEP_DIR)")
    p.add_argument(
        "--reference",
        metavar="ARM",
        help="the baseline arm, or dense for the sparsity-1 arm (default: grid.json's reference_arm)",
    )
    p.add_argument(
        "--targets",
        type=_targets,
        metavar="L1,L2,...",
        help="target losses for the multipliers, inside the measured final losses (default: 3 inside the overlap "
        "of the arms' losses)",
    )
    p.add_argument("--irreducible", action="store_true", help="fit L = E + A * C^(-alpha)")
    p.add_argument("--include-collapsed", action="store_true", help="keep collapsed cells in the fits")
    p.add_argument("--bootstrap", type=_count, default=1000, metavar="N", help="bootstrap resamples (default 1000)")
    p.add_argument("--level", type=_level, default=0.95, help="interval level (default 0.95)")
    p.add_argument("--seed", type=_count, default=0, help="the bootstrap's RNG seed (default 0)")
    return p


def _options(argv: list[str]) -> tuple[argparse.Namespace, ReportOptions]:
    """Parse and check everything that needs no cell read (``--reference`` against grid.json).
    Raises _UsageError or SweepInputError."""
    a = _parser().parse_args(argv)
    spec = read_grid_spec(a.sweep_dir)
    dense = next((c.arm for c in spec.cells if c.sparsity == 1), None)
    reference = dense if a.reference == "dense" and "dense" not in spec.arms else a.reference
    if reference is not None and reference not in spec.arms:
        allowed = ", ".join(spec.arms) + (f", dense (= {dense})" if dense else "")
        raise _UsageError(f"--reference={a.reference}; allowed: {allowed}")
    if a.out is not None:
        try:
            Path(a.out).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _UsageError(f"--out={a.out}: cannot create it ({e.strerror})") from None
    return a, ReportOptions(
        reference=reference,
        targets=a.targets,
        irreducible=a.irreducible,
        include_collapsed=a.include_collapsed,
        n_bootstrap=a.bootstrap,
        level=a.level,
        rng_seed=a.seed,
    )


def _check_targets(targets: tuple[float, ...] | None, grid: GridData) -> None:
    """Refuse (``_UsageError``) ``--targets`` outside every finished cell's final loss: a multiplier there
    is read off both fits beyond all the data. A target inside some arms' losses but not another's is
    kept; its multiplier is marked extrapolated."""
    losses = [c.final_val_loss for c in grid.cells if c.status == "finished"]
    outside = [t for t in targets or () if losses and not min(losses) <= t <= max(losses)]
    if outside:
        raise _UsageError(
            f"--targets: {', '.join(f'{t:g}' for t in outside)} outside the measured final losses "
            f"[{min(losses):.4f}, {max(losses):.4f}] (a multiplier there would be an extrapolation)"
        )


def report_main(argv: Sequence[str] | None = None, *, params_of=None) -> int:
    """``k2-sweep-report SWEEP_DIR [--out DIR] [--reference ARM] [--targets L,..] [--irreducible]
    [--include-collapsed] [--bootstrap N] [--level P] [--seed N]``.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        params_of: passed to :func:`~k2.launcher.tools.sweep_collect.collect_grid` (tests: a stand-in for
            the parameter count, which imports megatron-core).

    Returns:
        0 done (a partial grid too); 1 an output could not be written (a read-only directory, a full disk:
        one line on stderr naming the file and the cause; no report file written); 2 a bad argument, no
        grid.json or no readable cell (one line on stderr).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if any(x in ("-h", "--help") for x in args):  # anywhere, as every k2 tool (k2.launcher.cli.HELP_FLAGS)
        _parser().print_help()
        return 0
    try:
        a, opts = _options(args)
        grid = collect_grid(a.sweep_dir, params_of=params_of)
        _check_targets(a.targets, grid)
    except (_UsageError, SweepInputError) as e:
        print(f"k2-sweep-report: error: {e}", file=sys.stderr)
        return 2
    analysis = analyze(grid, opts)
    try:
        paths = write_report(grid, analysis, a.out or a.sweep_dir)
    except ReportWriteError as e:
        print(f"k2-sweep-report: error: {e}", file=sys.stderr)
        return 1
    print("\n".join(summary_lines(grid, analysis)))
    print("written: " + ", ".join(paths.values()))
    return 0


def report_cli() -> None:
    sys.exit(report_main())
