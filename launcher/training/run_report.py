"""The report of a run (``k2-report RUN_DIR``, and ``train.report=true`` at the end of a run): its curves
from ``<run.dir>/metrics.jsonl`` drawn into PNGs with matplotlib, and a summary in text.

PNGs (in ``<run.dir>/report/``), each against tokens (``consumed_tokens``) with the schedule's phase
boundaries marked (dotted lines, where the ``phase`` of the records changes):

* ``loss.png``: training loss per step and validation loss (``val_loss``, step 0 included);
* ``lr.png``: the learning rate of each step;
* ``grad_norm.png``: the global gradient norm (log scale);
* ``max_logit.png``: the largest attention logit of each step (``max_attn_logit``) with QK-Clip's
  threshold tau (``optim.qk_clip_tau`` of the run's ``config.yaml``) as a line;
* ``throughput.png``: tokens/s and, where ``metrics.jsonl`` has one, MFU;
* ``moe_balance.png``: expert load balance, the busiest expert's tokens over the mean
  (``moe_load_max_over_mean``; 1 = balanced), for MoE runs.

A figure is left out when the run logged none of its series. The plotted data are exactly the records'
values (:func:`run_series`), which the tests compare with ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

#: the directory of the PNGs inside the run dir
REPORT_DIR = "report"

#: figure name -> (title, y label, [(metrics.jsonl key, legend label)], log y)
FIGURES: dict[str, tuple[str, str, list[tuple[str, str]], bool]] = {
    "loss": ("Loss", "loss (nats/token)", [("loss", "training loss"), ("val_loss", "validation loss")], False),
    "lr": ("Learning rate", "LR", [("lr", "LR")], False),
    "grad_norm": ("Gradient norm", "global grad norm", [("grad_norm", "grad norm")], True),
    "max_logit": ("Max attention logit", "max logit", [("max_attn_logit", "max attention logit")], False),
    "throughput": ("Throughput", "tokens/s", [("tokens_per_s", "tokens/s")], False),
    "moe_balance": (
        "MoE load balance",
        "busiest expert / mean",
        [("moe_load_max_over_mean", "max / mean tokens per expert")],
        False,
    ),
}


@dataclass
class RunReport:
    """What :func:`write_run_report` drew and the summary it prints.

    Attributes:
        run_dir: the run directory.
        pngs: figure name -> written PNG path.
        summary: ``[(label, value text)]``, in print order.
    """

    run_dir: Path
    pngs: dict = field(default_factory=dict)
    summary: list = field(default_factory=list)

    def text(self) -> str:
        """The summary as printed: one ``label: value`` line each, then the PNGs."""
        width = max(len(k) for k, _ in self.summary)
        lines = [f"k2-report: {self.run_dir}"] + [f"  {k:<{width}}  {v}" for k, v in self.summary]
        if self.pngs:
            lines.append(
                f"  {'figures':<{width}}  {Path(next(iter(self.pngs.values()))).parent}/: "
                + ", ".join(Path(p).name for p in self.pngs.values())
            )
        return "\n".join(lines)


def load_records(run_dir) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` in order (a torn last line of a running or killed run is
    skipped).

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
    """
    recs = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return recs


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def run_series(records: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Per ``metrics.jsonl`` key: ``(tokens, values)`` of the records that hold a finite value for it
    (tokens = ``consumed_tokens`` after the step; the evaluation before training at 0)."""
    keys = {k for _, _, series, _ in FIGURES.values() for k, _ in series} | {"mfu"}
    out = {}
    for key in sorted(keys):
        pts = [(float(r["consumed_tokens"]), float(r[key])) for r in records if _finite(r.get(key))]
        if pts:
            out[key] = ([x for x, _ in pts], [y for _, y in pts])
    return out


def phase_boundaries(records: list[dict]) -> list[tuple[float, str]]:
    """``(tokens, phase entered)`` where the ``phase`` of consecutive step records changes."""
    out, prev = [], None
    for r in records:
        if r.get("step", 0) < 1 or "phase" not in r:
            continue
        if prev is not None and r["phase"] != prev["phase"]:
            out.append((float(prev["consumed_tokens"]), str(r["phase"])))
        prev = r
    return out


def _config_value(run_dir: Path, key: str):
    """``key`` (dotted) of the run's ``config.yaml``; None when there is no file or no such key."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.select(OmegaConf.load(path), key)


def _tau(run_dir: Path) -> float | None:
    """``optim.qk_clip_tau`` of the run's ``config.yaml`` (None: no file, or QK-Clip off)."""
    tau = _config_value(run_dir, "optim.qk_clip_tau")
    return float(tau) if tau is not None else None


def moe_ceiling(run_dir: Path) -> float | None:
    """The largest ``moe_load_max_over_mean`` a step can show: experts / top-k, every token of some MoE
    layer on the same top-k experts (a collapsed router). None without a MoE config."""
    experts, topk = _config_value(run_dir, "model.num_moe_experts"), _config_value(run_dir, "model.moe_router_topk")
    return experts / topk if experts and topk else None


#: what the MoE load figure calls healthy, from measurement on the CPU proxy (k2_tiny, 8 experts, top-2,
#: 2,048-token steps): with the weights frozen and the expert bias converged, single steps still show
#: 1.3-1.7, because a step's 16 sequences route unevenly by their content; a collapsed layer sits near
#: the ceiling (3.6-4.0 with K2's bias rate 1e-3 on that proxy; recipes/model/k2_tiny.yaml)
MOE_HEALTHY = "healthy: flat and far below the ceiling; one step's own batch makes 1.3-1.7 on the CPU proxy"


def draw_figures(series: dict, boundaries: list, tau: float | None, ceiling: float | None = None) -> dict:
    """figure name -> matplotlib ``Figure`` (one line per series of :data:`FIGURES` present, in that
    order; MFU on a second axis of ``throughput``; tau as a dashed line; phase boundaries dotted; on the
    MoE load figure, 1 = balanced and ``ceiling`` = collapsed (:func:`moe_ceiling`) as dashed lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    for name, (title, ylabel, keys, log) in FIGURES.items():
        present = [(k, label) for k, label in keys if k in series]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for k, label in present:
            xs, ys = series[k]
            ax.plot(xs, ys, marker="o" if k == "val_loss" else None, ms=3, lw=1.2, label=label)
        if name == "max_logit" and tau is not None:
            ax.axhline(tau, color="red", ls="--", lw=1, label=f"QK-Clip tau = {tau:g}")
        if name == "moe_balance":
            ax.axhline(1.0, color="green", ls="--", lw=1, label="1 = balanced")
            if ceiling is not None:
                ax.axhline(ceiling, color="red", ls="--", lw=1, label=f"{ceiling:g} = collapsed (experts / top-k)")
        handles = []
        if name == "throughput" and "mfu" in series:
            ax2 = ax.twinx()
            handles = ax2.plot(
                *[[100 * y for y in v] if i else v for i, v in enumerate(series["mfu"])], color="C1", lw=1, label="MFU"
            )
            ax2.set_ylabel("MFU (%)")
        for x, phase in boundaries:
            ax.axvline(x, color="gray", ls=":", lw=0.8)
            ax.annotate(
                phase,
                (x, 1),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color="gray",
            )
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}\n({MOE_HEALTHY})" if name == "moe_balance" else title)
        # one legend below the axes: inside them it covered the phase names at the top and the curves
        lines = ax.get_legend_handles_labels()[0] + handles
        ax.legend(
            handles=lines,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.16),
            ncol=min(len(lines), 4),
            fontsize=8,
            frameon=False,
        )
        fig.tight_layout()
        figs[name] = fig
    return figs


def summarize(records: list[dict], series: dict, run_dir: Path) -> list[tuple[str, str]]:
    """The summary lines of a run (steps, tokens, losses, throughput, MFU, max logit, MoE balance, wandb)."""
    steps = [r for r in records if r.get("step", 0) >= 1 and "loss" in r]
    out = [("steps", f"{steps[-1]['step']:,} ({steps[-1]['consumed_tokens']:,} tokens)" if steps else "none yet")]
    if steps:
        out.append(
            ("last phase", f"{steps[-1].get('phase', '-')} at {steps[-1].get('seq_length', '-')} tokens per sequence")
        )
        out.append(("final loss", f"{steps[-1]['loss']:.4f}"))
    if "val_loss" in series:
        xs, ys = series["val_loss"]
        best = min(range(len(ys)), key=ys.__getitem__)
        out.append(("val loss", f"{ys[-1]:.4f} last, {ys[best]:.4f} best (at {xs[best]:,.0f} tokens)"))
    if "tokens_per_s" in series:
        ys = series["tokens_per_s"][1]
        out.append(("tokens/s", f"{statistics.median(ys):,.0f} median ({min(ys):,.0f}-{max(ys):,.0f})"))
    mfu_ys = series.get("mfu", ([], []))[1]
    out.append(
        (
            "MFU",
            f"{100 * statistics.median(mfu_ys):.2f}% median"
            if mfu_ys
            else "none (a CPU run without cluster.cpu_peak_tflops: no peak to measure against)",
        )
    )
    if "max_attn_logit" in series:
        clipped = sum(int(r.get("qk_clipped_heads") or 0) for r in steps)
        tau = _tau(run_dir)
        clip = (
            f"QK-Clip at tau {tau:g} clipped {clipped:,} head-steps"
            if tau is not None
            else "QK-Clip off: optim.qk_clip_tau is null"
        )
        out.append(("max attn logit", f"{max(series['max_attn_logit'][1]):.2f} ({clip})"))
    if "moe_load_max_over_mean" in series:
        ys = series["moe_load_max_over_mean"][1]
        ceiling = moe_ceiling(run_dir)
        scale = f"; 1 = balanced, {ceiling:g} = collapsed" if ceiling else "; 1 = balanced"
        out.append(
            (
                "MoE balance",
                f"busiest expert {ys[-1]:.2f}x the mean (last step), {max(ys):.2f}x max, "
                f"{statistics.median(ys[len(ys) // 5 :]):.2f}x median after the first fifth{scale}",
            )
        )
    wandb_dir = run_dir / "wandb"
    if wandb_dir.is_dir():
        offline = sorted(p.name for p in wandb_dir.glob("offline-run-*"))
        out.append(
            ("wandb", f"{wandb_dir}" + (f" (offline; upload: wandb sync {wandb_dir}/{offline[-1]})" if offline else ""))
        )
    return out


def write_run_report(run_dir, out_dir=None) -> RunReport:
    """Draw the PNGs of :data:`FIGURES` for the run in ``run_dir`` into ``out_dir`` (default
    ``<run_dir>/report``) and compute its summary; works on a running run too (what is logged so far).

    Raises:
        FileNotFoundError: ``run_dir`` holds no ``metrics.jsonl``.
    """
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = load_records(run_dir)
    series = run_series(records)
    out = Path(out_dir) if out_dir is not None else run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    report = RunReport(run_dir, summary=summarize(records, series, run_dir))
    for name, fig in draw_figures(series, phase_boundaries(records), _tau(run_dir), moe_ceiling(run_dir)).items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        report.pngs[name] = str(path)
    return report
