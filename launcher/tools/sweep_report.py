"""``k2-sweep-report``'s engine: one row per sweep point (parameters, tokens, training FLOPs, final validation
loss, the FLOPs to reach ``sweep.val_loss_target`` interpolated in log FLOPs between evaluations, the
savings against the lowest sparsity), as CSV, Markdown and a plot of validation loss against FLOPs.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path


def _flops_to_target(curve: list[tuple[float, float]], target: float | None) -> float | None:
    """Training FLOPs at which the validation loss first reaches ``target``, interpolated linearly in
    log(FLOPs) between the two evaluations around the crossing; None when it never does."""
    if target is None:
        return None
    prev = None
    for f, v in curve:
        if v <= target:
            if prev is None or prev[1] == v or prev[0] <= 0:
                return f
            (f0, v0), (f1, v1) = prev, (f, v)
            t = (v0 - target) / (v0 - v1)
            return math.exp(math.log(f0) + t * (math.log(f1) - math.log(f0)))
        prev = (f, v)
    return None


def collect(sweep_dir) -> list[dict]:
    """One row per point directory under ``sweep_dir`` (``sparsity_*`` with config.yaml + metrics.jsonl).

    Raises:
        ValueError: no point directory.
    """
    from omegaconf import OmegaConf

    from k2.model.flops import flops_per_token  # (here: --help must not wait for the model's imports)
    from k2.model.params import count_params

    rows = []
    dirs = sorted((d for d in Path(sweep_dir).glob("sparsity_*") if d.is_dir() and ".stale-" not in d.name),
                  key=lambda d: int(d.name.split("_")[1]))
    for d in dirs:
        if not (d / "config.yaml").exists() or not (d / "metrics.jsonl").exists():
            continue
        cfg = OmegaConf.load(d / "config.yaml")
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        params = count_params(cfg)
        flops, curve, per_token, prev_tokens = 0.0, [], {}, 0
        for r in recs:  # each step's tokens at its own context length
            if r["step"] == 0:  # the evaluation before training: no FLOPs yet (a log-FLOPs curve)
                continue
            seq = int(r["seq_length"])
            if seq not in per_token:
                per_token[seq] = flops_per_token(cfg.model, seq).training
            flops += per_token[seq] * (r["consumed_tokens"] - prev_tokens)
            prev_tokens = r["consumed_tokens"]
            if "val_loss" in r:
                curve.append((flops, float(r["val_loss"])))
        target = cfg.sweep.val_loss_target if "sweep" in cfg else None
        rows.append({
            "sparsity": int(cfg.model.num_moe_experts) // int(cfg.model.moe_router_topk),
            "experts": int(cfg.model.num_moe_experts),
            "topk": int(cfg.model.moe_router_topk),
            "params_total": params.total,
            "params_active": params.active,
            "steps": recs[-1]["step"] if recs else 0,
            "tokens": recs[-1]["consumed_tokens"] if recs else 0,
            "flops": flops,
            "final_val_loss": curve[-1][1] if curve else None,
            "val_loss_target": target,
            "flops_to_target": _flops_to_target(curve, target),
            "curve": curve,
            "run_dir": str(d),
        })
    if not rows:
        raise ValueError(f"{sweep_dir}: no sweep point (sparsity_*/config.yaml + metrics.jsonl) found")
    base = rows[0]["flops_to_target"]
    for row in rows:
        f = row["flops_to_target"]
        row["flops_savings_vs_lowest"] = (base / f) if (base and f) else None
    return rows


COLUMNS = ("sparsity", "experts", "params_total", "params_active", "tokens", "flops", "final_val_loss",
           "flops_to_target", "flops_savings_vs_lowest")


def _fmt(key: str, v) -> str:
    if v is None:
        return "not reached" if key in ("flops_to_target", "flops_savings_vs_lowest") else "-"
    if key in ("flops", "flops_to_target"):
        return f"{v:.3e}"
    if key == "final_val_loss":
        return f"{v:.4f}"
    if key == "flops_savings_vs_lowest":
        return f"{v:.2f}x"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def write_report(rows: list[dict], out_dir) -> dict:
    """``sweep.csv``, ``sweep.md`` and ``sweep.png`` (validation loss vs training FLOPs, one curve per
    sparsity, the target as a line) in ``out_dir``. Returns their paths."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    with open(out / "sweep.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow(["" if r[c] is None else r[c] for c in COLUMNS])
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(c, r[c]) for c in COLUMNS) + " |" for r in rows]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r["curve"]:
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, marker="o", ms=3, label=f"sparsity {r['sparsity']} ({r['experts']} experts)")
    target = rows[0]["val_loss_target"]
    if target is not None:
        ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target}")
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation loss")
    ax.set_title("Sparsity sweep: validation loss vs training FLOPs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=120)
    plt.close(fig)
    return {k: str(out / f"sweep.{k}") for k in ("csv", "md", "png")}


USAGE = """usage: k2-sweep-report SWEEP_DIR

Read the sweep.dir of a `k2-train -m +experiment=sparsity_sweep` run (one sparsity_<S>/ run dir per point)
and print one row per point (parameters, tokens, training FLOPs, final validation loss, the FLOPs to reach
sweep.val_loss_target and the savings against the lowest sparsity); writes sweep.csv, sweep.md and sweep.png
(validation loss against training FLOPs) into SWEEP_DIR.

exit status: 0 done, 2 a bad argument or no sweep point in SWEEP_DIR
"""


def comparison_line(row: dict, base: dict) -> str:
    """One line comparing a point's FLOPs to ``sweep.val_loss_target`` with the lowest sparsity's (``base``)."""
    target, s = row["val_loss_target"], row["flops_savings_vs_lowest"]
    if s:
        return (f"sparsity {row['sparsity']} reaches val loss {target} with {s:.2f}x fewer FLOPs than sparsity "
                f"{base['sparsity']}")
    missed = [f"sparsity {r['sparsity']}" for r in (base, row) if r["flops_to_target"] is None]
    return (f"sparsity {row['sparsity']}: FLOPs to val loss {target} not comparable with sparsity {base['sparsity']} "
            f"({' and '.join(missed)} did not reach it)")


def report_main(argv: Sequence[str] | None = None) -> int:
    """``k2-sweep-report SWEEP_DIR``: print the table and the FLOP savings; write CSV/Markdown/PNG there."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE, end="")
        return 0
    if len(args) != 1:
        print(USAGE.splitlines()[0], file=sys.stderr)
        print(f"k2-sweep-report: error: expected one SWEEP_DIR, got {len(args)} arguments", file=sys.stderr)
        return 2
    try:
        rows = collect(args[0])
    except ValueError as e:
        print(f"k2-sweep-report: error: {e}", file=sys.stderr)
        return 2
    paths = write_report(rows, args[0])
    print(Path(paths["md"]).read_text(), end="")
    if rows[0]["val_loss_target"] is not None:
        for r in rows[1:]:
            print(comparison_line(r, rows[0]))
    print(f"written: {paths['csv']}, {paths['md']}, {paths['png']}")
    return 0


def report_cli() -> None:
    sys.exit(report_main())
