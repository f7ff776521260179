"""``k2-sweep-report``'s loss-vs-FLOPs figure on grids built in memory: distinct FLOPs tick labels over a
range narrower than a decade (where matplotlib's log locator falls back to linear ticks)."""

from __future__ import annotations

import pytest

from k2.launcher.tools.sweep_analysis import ReportOptions, analyze
from k2.launcher.tools.sweep_collect import Cell, CellSpec, GridData, GridSpec
from k2.launcher.tools.sweep_plots import loss_vs_flops_figure, sci_labels


def grid_of(flops: list[float], sparsities=(1, 4), seeds=(1, 2)) -> GridData:
    """Finished cells at ``flops`` (one budget each), ``L = 5 (C / 1e10)^-0.06`` (2% lower when sparse)."""
    cells = []
    for s in sparsities:
        arm = f"sparsity_{s}"
        for seed in seeds:
            for i, c in enumerate(flops):
                spec = CellSpec(f"{arm}/{seed}/{i}", arm, s, 2 * s, None, seed, 1024 * (i + 1), i, "trunk", "run")
                loss = (1.0 if s == 1 else 0.98) * 5.0 * (c / 1e10) ** -0.06 + 0.002 * seed
                cells.append(
                    Cell(spec, "finished", flops=c, final_val_loss=loss, curve=[(c * 0.8, loss + 0.05), (c, loss)])
                )
    return GridData(GridSpec("g", 2, "sparsity_1", {}, 2.0, 2, tuple(c.spec for c in cells)), cells, ".")


@pytest.mark.parametrize("lo, hi", [(2.0e11, 4.0e11), (2.1e11, 2.6e11), (1e12, 1e13)])
def test_flops_tick_labels_are_distinct(lo, hi):
    grid = grid_of([lo, lo * (hi / lo) ** 0.25, lo * (hi / lo) ** 0.5, lo * (hi / lo) ** 0.75, hi])
    fig = loss_vs_flops_figure(grid, analyze(grid, ReportOptions(n_bootstrap=0)))
    fig.canvas.draw()
    ax = fig.axes[0]
    x0, x1 = ax.get_xlim()
    labels = [t.get_text() for t in ax.xaxis.get_majorticklabels() if x0 <= t.get_position()[0] <= x1]
    assert len(labels) >= 2 and len(set(labels)) == len(labels), labels


def test_sci_labels():
    assert sci_labels([1e12, 2e12, 5e12]) == ["1e+12", "2e+12", "5e+12"]
    assert sci_labels([2e11, 2.5e11, 3e11]) == ["2e+11", "2.5e+11", "3e+11"]
    assert sci_labels([2.1e11, 2.15e11, 2.2e11]) == ["2.1e+11", "2.15e+11", "2.2e+11"]
