"""Picture of a schedule (``k2-plan plot_schedule=PATH.png``): learning rate and context length over tokens.

Top row: the LR over the whole run (left) and a zoom on the last phases (right; K2's 460B-token anneal
is 3% of the run and would otherwise be a few pixels wide), phase boundaries dotted and named, the LR
written at each boundary. Bottom row: the context length of each phase (log2 axis) with the global
batch in sequences; a zero-length last phase (K2's YaRN extension) is drawn as the final setting.
Uses matplotlib (Agg backend, no display needed).
"""

from __future__ import annotations

from k2.schedules.wsd import Schedule


def _tokens_unit(total: float) -> tuple[float, str]:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if total >= 10 * div:
            return div, suffix
    return 1.0, ""


def _ctx_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _lr_curve(schedule: Schedule, lo: float, hi: float, n: int = 600) -> tuple[list[float], list[float]]:
    xs = [lo + (hi - lo) * i / (n - 1) for i in range(n)]
    # exact boundary points so corners are sharp
    xs += [p.start_tokens for p in schedule.phases if lo <= p.start_tokens <= hi]
    xs = sorted(set(xs))
    return xs, [schedule.lr_at(x) for x in xs]


def plot_schedule(schedule: Schedule, path: str, title: str | None = None) -> str:
    """Write the schedule picture to ``path`` (PNG). Returns ``path``.

    Raises:
        OSError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = schedule.end_tokens
    div, unit = _tokens_unit(end)
    running = [p for p in schedule.phases if p.tokens > 0]
    final = schedule.phases[-1] if schedule.phases[-1].tokens == 0 else None
    # zoom: the trailing phases that together are at most 6% of the run (at least the last one)
    tail_start = running[-1].start_tokens
    for p in reversed(running):
        if end - p.start_tokens <= 0.06 * end:
            tail_start = p.start_tokens
    margin = 0.35 * (end - tail_start)
    zoom = (max(0.0, tail_start - margin), end + 0.08 * (end - tail_start + margin))

    fig, axes = plt.subplots(
        2,
        2,
        figsize=(11, 5.6),
        dpi=100,
        sharex="col",
        gridspec_kw={"width_ratios": [2.2, 1], "height_ratios": [2.3, 1]},
    )
    (ax_lr, ax_lrz), (ax_ctx, ax_ctxz) = axes

    _draw_lr(schedule, running, zoom, div, (ax_lr, ax_lrz))
    _label_phases(schedule, running, zoom, div, (ax_lr, ax_lrz))
    _draw_context(schedule, running, final, zoom, div, unit, (ax_ctx, ax_ctxz))

    fig.suptitle(
        title
        or (
            f"schedule {schedule.name}: learning rate and context length over {end / div:,.4g}{unit} tokens; "
            f"{schedule.total_steps:,} steps of {schedule.global_batch_tokens:,} tokens; weight decay "
            f"{schedule.weight_decay:g}"
        ),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]


def _draw_lr(schedule: Schedule, running: list, zoom: tuple, div: float, axes: tuple) -> None:
    """The LR curve over the whole run and over the zoom, the phases shaded."""
    ax_lr, ax_lrz = axes
    end, colors = schedule.end_tokens, _COLORS
    for ax, (lo, hi) in ((ax_lr, (0.0, float(end))), (ax_lrz, zoom)):
        xs, ys = _lr_curve(schedule, lo, min(hi, end))
        if hi > end:
            xs, ys = xs + [hi], ys + [ys[-1]]
        ax.plot([x / div for x in xs], ys, color="black", lw=1.6)
        for k, p in enumerate(running):
            a, b = max(p.start_tokens, lo), min(p.end_tokens, hi)
            if b <= a:
                continue
            ax.axvspan(a / div, b / div, color=colors[k % len(colors)], alpha=0.10, lw=0)
            if p.start_tokens >= lo:
                ax.axvline(p.start_tokens / div, color="grey", ls=":", lw=0.8)
        ax.axvline(end / div, color="grey", ls=":", lw=0.8)
        ax.set_xlim(lo / div, hi / div)
        top = max(ys) if ax is ax_lrz else schedule.peak_lr
        ax.set_ylim(0, top * 1.3)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        ax.grid(alpha=0.25)
    ax_lr.set_ylabel("learning rate")
    ax_lrz.set_title("zoom: end of the run", fontsize=9)

    ax_lr.set_ylabel("learning rate")
    ax_lrz.set_title("zoom: end of the run", fontsize=9)


def _label_phases(schedule: Schedule, running: list, zoom: tuple, div: float, axes: tuple) -> None:
    """Phase names and the LR at each boundary (boundaries inside the zoom are labelled there only)."""
    ax_lr, ax_lrz = axes
    end, colors = schedule.end_tokens, _COLORS
    for ax, (lo, hi) in ((ax_lr, (0.0, zoom[0])), (ax_lrz, zoom)):
        width = (ax.get_xlim()[1] - ax.get_xlim()[0]) * div
        ytop = ax.get_ylim()[1]
        for k, p in enumerate(running):
            a, b = max(p.start_tokens, ax.get_xlim()[0] * div), min(p.end_tokens, ax.get_xlim()[1] * div)
            if b <= a:
                continue
            if (b - a) >= 0.04 * width:
                ax.text(
                    (a + b) / 2 / div,
                    ytop * 0.97,
                    p.name,
                    ha="center",
                    va="top",
                    fontsize=8,
                    color=colors[k % len(colors)],
                )
            elif ax is ax_lr and p.end_tokens <= zoom[0]:  # too narrow to name (K2's warmup)
                ax.annotate(
                    f"{p.name} ({p.steps:,} steps): {p.lr_start:.3g} -> {p.lr_end:.3g}",
                    (b / div, p.lr_end * 0.5),
                    xytext=(0.03 * width / div + b / div, p.lr_end * 0.45),
                    fontsize=7,
                    color=colors[k % len(colors)],
                    arrowprops=dict(arrowstyle="->", color=colors[k % len(colors)], lw=0.8),
                )
        shown = set()
        for p in running:
            for x, lr in ((p.start_tokens, p.lr_start), (p.end_tokens, p.lr_end)):
                if not lo <= x <= hi or x in shown or (x == 0 and lr == 0):
                    continue
                shown.add(x)
                ax.plot([x / div], [lr], "o", color="black", ms=3)
                last = x == end  # the curve arrives from the upper left: label below it
                ax.annotate(
                    f"{lr:.3g}",
                    (x / div, lr),
                    textcoords="offset points",
                    xytext=(-3, -12) if last else (3, 5),
                    ha="right" if last else "left",
                    fontsize=7,
                )


def _draw_context(schedule: Schedule, running: list, final, zoom: tuple, div: float, unit: str, axes: tuple) -> None:
    """The context length and global batch of each phase, and the final setting (YaRN) at the end."""
    ax_ctx, ax_ctxz = axes
    end, colors = schedule.end_tokens, _COLORS
    for ax, (lo, hi) in ((ax_ctx, (0.0, float(end))), (ax_ctxz, zoom)):
        for k, p in enumerate(running):
            a, b = max(p.start_tokens, lo), min(p.end_tokens, hi)
            if b <= a:
                continue
            ax.plot([a / div, b / div], [p.seq_length] * 2, color=colors[k % len(colors)], lw=3)
            if (b - a) >= 0.08 * (hi - lo):
                ax.text(
                    (a + b) / 2 / div,
                    p.seq_length * 1.25,
                    f"{_ctx_label(p.seq_length)} x {p.global_batch_size:,} seqs",
                    ha="center",
                    fontsize=7,
                )
        if final is not None and hi >= end:
            ax.plot([end / div], [final.seq_length], marker=">", color="black", ms=6)
            ax.annotate(
                f"{final.name}: {_ctx_label(final.seq_length)} {final.rope_type} (final setting)",
                (end / div, final.seq_length),
                textcoords="offset points",
                xytext=(-4, -11),
                ha="right",
                fontsize=7,
            )
        lengths = sorted({p.seq_length for p in schedule.phases})
        ax.set_yscale("log", base=2)
        ax.set_yticks(lengths, [_ctx_label(n) for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(min(lengths) / 2, max(lengths) * 2.5)
        ax.set_xlabel(f"tokens ({unit})" if unit else "tokens")
        ax.grid(alpha=0.25)
    ax_ctx.set_ylabel("context length")
