"""``k2-sweep-report``'s two figures, drawn with matplotlib (Agg) from a collected grid and its analysis:

* :func:`plot_loss_vs_flops`: validation loss against training FLOPs per arm, as K2's Figure 5 (arXiv
  2507.20534, section 2.3) draws it: every cell's evaluation curve thin (a branch shares its trunk's curve up
  to the branch point, marked with a triangle where a loss was measured there or between two of the trunk's
  evaluations around it), the finished cells' end points (an ``x``: collapsed, left out of the fit), and the
  arm's fitted ``L = A * C^(-alpha)`` over its measured FLOPs; the FLOPs ticks labelled with as many digits
  as keep them distinct (:func:`sci_labels`);
* :func:`plot_multipliers`: the compute multiplier against the reference arm vs sparsity, one series per
  target loss, with the bootstrap interval as error bars.
"""

from __future__ import annotations

import numpy as np

from k2.launcher.tools.sweep_analysis import Analysis, arm_label
from k2.launcher.tools.sweep_collect import GridData

__all__ = ["loss_vs_flops_figure", "plot_loss_vs_flops", "plot_multipliers", "sci_labels"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(arms: list[str]) -> dict[str, str]:
    return {a: f"C{i % 10}" for i, a in enumerate(arms)}  # matplotlib's default cycle, in sparsity order


def _sci(v: float, digits: int) -> str:
    mantissa, exp = f"{v:.{digits}e}".split("e")
    return (mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa) + "e" + exp


def sci_labels(values) -> list[str]:
    """Tick labels in scientific notation with as few significant digits as keep them distinct (``2e+11,
    2.5e+11, 3e+11``; trailing zeros dropped)."""
    for digits in range(6):
        labels = [_sci(float(v), digits) for v in values]
        if len(set(labels)) == len(labels):
            break
    return labels


def _sci_formatter():
    """A :class:`matplotlib.ticker.Formatter` of :func:`sci_labels` (3 digits for a single value)."""
    from matplotlib import ticker

    class _Formatter(ticker.Formatter):
        def __call__(self, x, pos=None):
            return _sci(x, 3)

        def format_ticks(self, values):
            return sci_labels(values)

    return _Formatter()


def loss_vs_flops_figure(grid: GridData, analysis: Analysis):
    """The loss-vs-FLOPs figure (a matplotlib Figure; the caller saves and closes it)."""
    plt = _pyplot()
    from matplotlib import ticker

    colors = _colors(list(analysis.arms))
    fig, ax = plt.subplots(figsize=(8, 5))
    for cell in grid.cells:
        col = colors[cell.spec.arm]
        if cell.curve:
            xs, ys = zip(*cell.curve)
            ax.plot(xs, ys, color=col, lw=0.7, alpha=0.45)
        if cell.branch_point and cell.branch_point[1] is not None:  # a loss measured at (or around) the step
            ax.plot(*cell.branch_point, marker="^", ms=5, mfc="none", mec=col, ls="none")
        if cell.status == "finished":
            ax.plot(cell.flops, cell.final_val_loss, marker="x" if cell.collapsed else "o", ms=5, color=col, ls="none")
    for arm, af in analysis.arms.items():
        if af.fit is None:
            continue
        flops = [c.flops for c in af.cells]
        xs = np.geomspace(min(flops) / 1.15, max(flops) * 1.15, 100)
        label = f"{arm_label(arm, af.sparsity)}: alpha {af.fit.law.alpha:.3f}"
        ax.plot(xs, af.fit.law.loss(xs), color=colors[arm], lw=2, label=label)
    for t in analysis.targets:
        ax.axhline(t, color="gray", ls=":", lw=0.8)
    ax.set_xscale("log")
    # ticks at 1, 2 and 5 x 10^k: a sweep spans one or two decades, where matplotlib labels one tick or all;
    # over less than about a decade the locator falls back to linear ticks (2e11, 2.5e11, ...), which one
    # significant digit would label alike: sci_labels gives them as many digits as keep them distinct
    ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(_sci_formatter())
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("training FLOPs (router included)")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(
        f"{grid.spec.name}: validation loss vs training FLOPs (o finished, x collapsed, ^ branch point, : targets)",
        fontsize=9,
    )
    if ax.get_legend_handles_labels()[0]:  # no fit: nothing to name (an empty legend only warns)
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def plot_loss_vs_flops(grid: GridData, analysis: Analysis, path) -> None:
    """Write the loss-vs-FLOPs figure (PNG) to ``path`` (a file name or a binary file object)."""
    plt = _pyplot()
    fig = loss_vs_flops_figure(grid, analysis)
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def plot_multipliers(analysis: Analysis, path) -> None:
    """Write the multiplier-vs-sparsity figure (PNG) to ``path``: ``C_ref(L*) / C_arm(L*)`` per target, the
    reference at 1, error bars = the bootstrap interval (absent where none could be computed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ref = analysis.arms[analysis.reference]
    rows = analysis.multipliers.get(analysis.reference, [])
    n = max(len(analysis.targets), 1)
    for i, t in enumerate(analysis.targets):
        pts = [r for r in rows if r["target_loss"] == t and np.isfinite(r["multiplier"])]
        shift = 2 ** ((i - (n - 1) / 2) * 0.06)  # side by side on the log2 axis
        xs = [r["sparsity"] * shift for r in pts]
        ys = [r["multiplier"] for r in pts]
        err = np.array(
            [
                [max(r["multiplier"] - r["interval"][0], 0), max(r["interval"][1] - r["multiplier"], 0)]
                if r["interval"]
                else [0.0, 0.0]
                for r in pts
            ]
        ).T.reshape(2, -1)
        ax.errorbar(xs, ys, yerr=err, marker="o", ms=5, capsize=3, ls="-", lw=1, label=f"L* = {t:g}")
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.plot(
        [ref.sparsity],
        [1.0],
        marker="s",
        color="black",
        ls="none",
        label=f"reference: {arm_label(ref.arm, ref.sparsity)}",
    )
    spars = sorted({af.sparsity for af in analysis.arms.values()})
    ax.set_xscale("log", base=2)
    ax.set_xticks(spars, [str(s) for s in spars])
    ax.set_xlabel("sparsity (experts / top-k)")
    ax.set_ylabel("compute multiplier C_ref(L*) / C_arm(L*)")
    level = int(round(analysis.options.level * 100))
    ax.set_title(f"> 1: fewer FLOPs to reach L* than the reference; bars: {level}% seed-bootstrap interval", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
