"""k2-report / train.report: the PNGs drawn from a synthetic ``metrics.jsonl`` (no training) hold exactly the
records' values, the phase boundary and QK-Clip's tau; the summary and the command line."""

from __future__ import annotations

import json

import pytest

from k2.launcher import report as report_entry
from k2.launcher.training.run_report import FIGURES, draw_figures, phase_boundaries, run_series, write_run_report
from support.helpers import run_tool

B = 1024  # tokens per step


def _records() -> list[dict]:
    recs = [{"step": 0, "consumed_tokens": 0, "phase": "warmup", "seq_length": 128, "val_loss": 8.3}]
    for s in range(1, 7):
        r = {
            "step": s,
            "consumed_tokens": s * B,
            "phase": "warmup" if s <= 3 else "anneal",
            "seq_length": 128,
            "lr": 1e-3 * s / 6,
            "loss": 8.0 - 0.1 * s,
            "grad_norm": 2.0 / s,
            "tokens_per_s": 1000.0 + s,
            "mfu": None,
            "max_attn_logit": 10.0 + s,
            "qk_clipped_heads": s % 2,
            "moe_load_max_over_mean": 1.0 + 0.1 * s,
        }
        if s % 3 == 0:
            r["val_loss"] = 8.0 - 0.05 * s
        recs.append(r)
    return recs


@pytest.fixture()
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()) + '{"step": 7, "lo')
    (d / "config.yaml").write_text("optim:\n  qk_clip_tau: 12.5\nmodel:\n  num_moe_experts: 8\n  moe_router_topk: 2\n")
    return d


def test_plotted_series_equal_metrics_jsonl(run_dir):
    """Every line of every figure is the (tokens, value) of the records that hold that key, read here
    straight from the file (the torn last line of a running run skipped)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]]
    want = {
        key: [(r["consumed_tokens"], r[key]) for r in recs if r.get(key) is not None]
        for _, _, keys, _ in FIGURES.values()
        for key, _ in keys
    }
    figs = draw_figures(run_series(recs), phase_boundaries(recs), 12.5)
    assert set(figs) == set(FIGURES)
    for name, fig in figs.items():
        ax = fig.axes[0]
        keys = [k for k, _ in FIGURES[name][2]]
        data = [ln for ln in ax.lines if ln.get_linestyle() == "-"]
        assert len(data) == len(keys), name
        for key, line in zip(keys, data):
            assert [tuple(p) for p in line.get_xydata().tolist()] == [(float(x), float(y)) for x, y in want[key]]
        # the phase boundary: after step 3, at 3 B tokens, named by the phase entered
        assert [ln.get_xdata()[0] for ln in ax.lines if ln.get_linestyle() == ":"] == [3 * B], name
        assert [t.get_text() for t in ax.texts] == ["anneal"]
    tau = [ln for ln in figs["max_logit"].axes[0].lines if ln.get_linestyle() == "--"]
    assert len(tau) == 1 and list(tau[0].get_ydata()) == [12.5, 12.5]
    assert len(figs["throughput"].axes) == 1  # MFU null everywhere: no MFU axis
    # the MoE load figure says what healthy is: 1 = balanced, experts / top-k = collapsed, dashed
    figs = draw_figures(run_series(recs), phase_boundaries(recs), 12.5, 4.0)
    ax = figs["moe_balance"].axes[0]
    assert sorted(ln.get_ydata()[0] for ln in ax.lines if ln.get_linestyle() == "--") == [1.0, 4.0]
    assert "healthy" in ax.get_title() and "collapsed" in ax.get_legend_handles_labels()[1][-1]
    assert figs["loss"].axes[0].lines[1].get_xydata()[0].tolist() == [0.0, 8.3]  # val loss before training


def test_write_report_pngs_and_summary(run_dir):
    r = write_run_report(run_dir)
    assert sorted(r.pngs) == sorted(FIGURES)
    for path in r.pngs.values():
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    text = r.text()
    for needle in (
        "steps           6 (6,144 tokens)",
        "final loss      7.4000",
        "val loss        7.7000 last, 7.7000 best (at 6,144 tokens)",
        "tokens/s        1,004 median",
        "MFU             none (a CPU run",
        "max attn logit  16.00 (QK-Clip at tau 12.5 clipped 3 head-steps)",
        "MoE balance     busiest expert 1.60x the mean (last step), 1.60x max, 1.40x median after "
        "the first fifth; 1 = balanced, 4 = collapsed",
    ):
        assert needle in text, text
    # a run with QK-Clip off says so instead of counting clips
    (run_dir / "config.yaml").write_text("optim:\n  qk_clip_tau: null\n")
    assert "max attn logit  16.00 (QK-Clip off: optim.qk_clip_tau is null)" in write_run_report(run_dir).text()


def test_cli(run_dir, capsys, tmp_path):
    rc, out, _ = run_tool(capsys, report_entry.main, ["--help"])
    assert rc == 0 and out.startswith("usage: k2-report RUN_DIR")
    rc, _, err = run_tool(capsys, report_entry.main, [str(tmp_path / "nope")])
    assert (
        rc == 2
        and err
        == f"k2-report: error: {tmp_path / 'nope'} holds no metrics.jsonl: not a k2-train run "
        "dir (or no step logged yet)\n"
    )
    rc, out, _ = run_tool(capsys, report_entry.main, [str(run_dir), str(tmp_path / "pngs")])
    assert rc == 0 and out.startswith(f"k2-report: {run_dir}") and (tmp_path / "pngs" / "loss.png").exists()


def test_legend_covers_no_phase_name_and_no_curve(run_dir):
    """The legend sits below the axes: its box overlaps neither the axes (curves, the phase names at
    their top) nor the x axis label, and it names every line (MFU's too, from its second axis)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]]
    for r in recs:
        r["mfu"] = 0.3 if r["step"] else None
    figs = draw_figures(run_series(recs), phase_boundaries(recs), 12.5)
    for name, fig in figs.items():
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        legend = ax.get_legend().get_window_extent(renderer)
        assert not legend.overlaps(ax.get_window_extent(renderer)), name
        assert not legend.overlaps(ax.xaxis.label.get_window_extent(renderer)), name
        assert all(not legend.overlaps(t.get_window_extent(renderer)) for t in ax.texts), name
        assert fig.get_window_extent(renderer).contains(legend.x0, legend.y0), name  # not cut off
    labels = [t.get_text() for t in figs["throughput"].axes[0].get_legend().get_texts()]
    assert labels[-1] == "MFU" and len(labels) == 2
