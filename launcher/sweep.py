"""Sparsity sweep: K2's sparsity scaling experiment as one command (REFERENCE.md, "Model": at fixed
activated parameters and top-k, grow the number of experts; sparsity = experts / top-k).

``k2-train -m +experiment=sparsity_sweep`` (``-m`` / ``--multirun``, Hydra's multirun flag) runs one
training per ``sweep.sparsities`` entry, one after another on this machine; ``k2-submit -m
+experiment=sparsity_sweep`` submits one Slurm job per point instead. A point differs from the base config
only in ``model.num_moe_experts = sparsity x model.moe_router_topk`` (expert width and shared expert
unchanged, so the activated parameters and the GEMM FLOPs per token are the same; the router's
``2 h E`` FLOPs per token grow with E and are reported apart), and has a stable run dir
``<sweep.dir>/sparsity_<S>``: a re-run of the same command skips the finished points and resumes the
others from their checkpoints (launcher/checkpoint.py). Every point is validated (layout, EP vs expert
count, schedule) before anything runs; an error names the point.

The sweep is expanded here rather than by Hydra's BasicSweeper because a point is *derived* from the
sparsity (experts = sparsity x top-k) and must be validated and skipped-if-finished as a whole; the points
are ordinary ``k2-train`` runs with Hydra overrides, so each one can also be run or resubmitted by hand.

``k2-sweep-report SWEEP_DIR`` (:func:`report`) collects the points' metrics into a table and a plot.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from launcher.config import ConfigError, load_config

MULTIRUN_FLAGS = ("-m", "--multirun")


@dataclass(frozen=True)
class Point:
    """One sweep point: its sparsity, expert count, run dir and the full ``k2-train`` overrides."""

    sparsity: int
    experts: int
    run_dir: str
    overrides: tuple

    @property
    def name(self) -> str:
        return f"sparsity_{self.sparsity}"


def split_multirun(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """``(True, argv without -m)`` when ``-m`` / ``--multirun`` is present."""
    args = list(argv)
    multirun = any(a in MULTIRUN_FLAGS for a in args)
    return multirun, [a for a in args if a not in MULTIRUN_FLAGS]


def sweep_points(overrides: Sequence[str]) -> tuple[object, list[Point]]:
    """The base config and the points of the sweep it declares (``sweep.*``).

    Raises:
        ConfigError: no ``sweep.sparsities``, a sparsity < 1, duplicates, or a model without experts.
    """
    cfg = load_config(list(overrides))
    sw = cfg.sweep
    if not sw.sparsities:
        raise ConfigError("k2-train -m needs sweep.sparsities (e.g. +experiment=sparsity_sweep); "
                          "allowed: a list of integers >= 1")
    sparsities = [int(s) for s in sw.sparsities]
    if min(sparsities) < 1 or len(set(sparsities)) != len(sparsities):
        raise ConfigError(f"sweep.sparsities={sparsities}; allowed: distinct integers >= 1")
    if not cfg.model.num_moe_experts:
        raise ConfigError(f"sweep over sparsity needs a MoE model; model={cfg.model.name} has "
                          "model.num_moe_experts=null")
    topk = int(cfg.model.moe_router_topk)
    base = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in
            ("model.num_moe_experts", "run.dir", "run.wandb.group", "run.wandb.name")]
    points = []
    for s in sparsities:
        run_dir = str(Path(sw.dir) / f"sparsity_{s}")
        points.append(Point(s, s * topk, run_dir, tuple(base + [
            f"model.num_moe_experts={s * topk}", f"run.dir={run_dir}",
            f"run.wandb.group={sw.name}", f"run.wandb.name={sw.name}-sparsity_{s}"])))
    return cfg, points


def gemm_flops_per_token(model_cfg, seq_length: int) -> float:
    """Training FLOPs per token of everything but the router (the part the sweep keeps fixed)."""
    from model.flops import TRAINING_FACTOR, flops_per_token

    f = flops_per_token(model_cfg, seq_length)
    terms = f.terms()
    return TRAINING_FACTOR * (sum(terms.values()) - terms["router"])


def check_points(points: list[Point], world_size_of) -> dict:
    """Validate every point as ``k2-train`` would (no process starts) and confirm equal activated FLOPs.

    Args:
        world_size_of: cfg -> the world size the point will run with.

    Returns:
        ``{point name: plan}``.

    Raises:
        ConfigError: naming the point (sparsity and expert count) and the setting.
    """
    from launcher.train import make_plan

    plans, flops = {}, {}
    for p in points:
        try:
            cfg = load_config(list(p.overrides))
            plans[p.name] = make_plan(cfg, world_size_of(cfg))
        except ConfigError as e:
            raise ConfigError(f"sweep point sparsity={p.sparsity} (model.num_moe_experts={p.experts}, "
                              f"run.dir={p.run_dir}): {e}") from None
        seq = plans[p.name].schedule.step_phase(1).seq_length
        flops[p.name] = gemm_flops_per_token(cfg.model, seq)
    if len(set(flops.values())) != 1:
        raise ConfigError(f"sweep points differ in FLOPs per token beyond the router: {flops}")
    return plans


def point_status(point: Point, plan) -> str:
    """``finished`` (a checkpoint at the run's last step), ``partial`` (an earlier checkpoint) or ``new``."""
    from launcher.checkpoint import latest_checkpoint, read_state

    ck = latest_checkpoint(point.run_dir)
    if ck is None:
        return "new"
    return "finished" if int(read_state(ck)["step"]) >= plan.steps else "partial"


def set_aside_unresumable(point: Point) -> Optional[Path]:
    """A point killed before its first checkpoint left metrics but nothing to resume from: move its run dir
    to ``<run_dir>.stale-<time>`` so the point starts again. Returns the new path, or None."""
    from launcher.checkpoint import latest_checkpoint

    rd = Path(point.run_dir)
    if rd.exists() and (rd / "metrics.jsonl").exists() and latest_checkpoint(rd) is None:
        dest = rd.with_name(f"{rd.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
        rd.rename(dest)
        return dest
    return None


def _run_point(point: Point) -> int:
    """``k2-train <point overrides>`` in a child process; SIGTERM/SIGUSR1/SIGINT sent to the sweep are
    passed on to it (so a killed sweep stops its point with a checkpoint instead of orphaning it)."""
    import signal

    child = subprocess.Popen([sys.executable, "-m", "launcher.train", *point.overrides])

    def forward(signum, _frame):
        child.send_signal(signum)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    old = {sig: signal.signal(sig, forward) for sig in handled}
    try:
        return child.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run_sweep(overrides: Sequence[str]) -> int:
    """``k2-train -m ...``: validate all points, then run the unfinished ones one after another.

    Returns:
        0 when every point finished; the failing point's exit status otherwise (42 = preempted: re-run
        the same command to continue); 2 for a config error (nothing ran).
    """
    from launcher.slurm import REQUEUE_EXIT_CODE

    try:
        cfg, points = sweep_points(overrides)
        for p in points:
            moved = set_aside_unresumable(p)
            if moved:
                print(f"k2-train -m: {p.name}: no checkpoint to resume from; old run moved to {moved}")
        plans = check_points(points, lambda c: c.launch.nproc_per_node)
    except ConfigError as e:
        print(f"k2-train: error: {e}", file=sys.stderr)
        return 2
    status = {p.name: point_status(p, plans[p.name]) for p in points}
    print(f"k2-train -m: sweep '{cfg.sweep.name}' in {cfg.sweep.dir}: "
          + ", ".join(f"{p.name} (E={p.experts}): {status[p.name]}" for p in points), flush=True)
    for i, p in enumerate(points, 1):
        if status[p.name] == "finished":
            continue
        print(f"k2-train -m: [{i}/{len(points)}] {p.name}: k2-train {' '.join(p.overrides)}", flush=True)
        rc = _run_point(p)
        if rc != 0:
            what = "was preempted" if rc == REQUEUE_EXIT_CODE else f"failed (exit {rc})"
            print(f"k2-train -m: {p.name} {what}; re-run the same command to continue the sweep",
                  file=sys.stderr)
            return rc
    print(f"k2-train -m: all {len(points)} points finished; report: k2-sweep-report {cfg.sweep.dir}")
    return 0


# --- report ---------------------------------------------------------------------------------------------


def _flops_to_target(curve: list[tuple[float, float]], target: Optional[float]) -> Optional[float]:
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

    from model.flops import flops_per_token
    from model.params import count_params

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


def report_main(argv: Optional[Sequence[str]] = None) -> int:
    """``k2-sweep-report SWEEP_DIR``: print the table and the FLOP savings; write CSV/Markdown/PNG there."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: k2-sweep-report SWEEP_DIR  (the sweep.dir of a k2-train -m run)", file=sys.stderr)
        return 2
    try:
        rows = collect(args[0])
    except ValueError as e:
        print(f"k2-sweep-report: error: {e}", file=sys.stderr)
        return 2
    paths = write_report(rows, args[0])
    print(Path(paths["md"]).read_text(), end="")
    target = rows[0]["val_loss_target"]
    for r in rows[1:]:
        s = r["flops_savings_vs_lowest"]
        print(f"sparsity {r['sparsity']} reaches val loss {target} with "
              + (f"{s:.2f}x fewer FLOPs than sparsity {rows[0]['sparsity']}" if s else
                 "(not comparable: a point did not reach the target)"))
    print(f"written: {paths['csv']}, {paths['md']}, {paths['png']}")
    return 0


def report_cli() -> None:
    sys.exit(report_main())
