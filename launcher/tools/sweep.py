"""Sparsity sweep: K2's sparsity scaling experiment as one command (docs/k2_reference.md, "Model": at fixed
activated parameters and top-k, grow the number of experts; sparsity = experts / top-k).

``k2-train -m +experiment=sparsity_sweep`` (``-m`` / ``--multirun``, Hydra's multirun flag) runs one
training per ``sweep.sparsities`` entry, one after another on this machine; ``k2-submit -m
+experiment=sparsity_sweep`` submits one Slurm job per point instead. A point differs from the base config
only in ``model.num_moe_experts = sparsity x model.moe_router_topk`` (expert width and shared expert
unchanged, so the activated parameters and the GEMM FLOPs per token are the same; the router's
``2 h E`` FLOPs per token grow with E and are reported apart), and has a stable run dir
``<sweep.dir>/sparsity_<S>``: a re-run of the same command skips the finished points and resumes the
others from their checkpoints (:mod:`k2.launcher.checkpointing`). Every point is validated (layout, EP vs expert
count, schedule) before anything runs; an error names the point.

The sweep is expanded here rather than by Hydra's BasicSweeper because a point is *derived* from the
sparsity (experts = sparsity x top-k) and must be validated and skipped-if-finished as a whole; the points
are ordinary ``k2-train`` runs with Hydra overrides, so each one can also be run or resubmitted by hand.

``k2-sweep-report SWEEP_DIR`` (:mod:`k2.launcher.tools.sweep_report`) collects the points' metrics into a
table and a plot.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.checkpointing.paths import latest_checkpoint, read_state
from k2.launcher.training import fork_ranks
from k2.launcher.training.preemption import REQUEUE_EXIT_CODE
from k2.launcher.training.prepare import prepare_run
from k2.model.flops import TRAINING_FACTOR, flops_per_token

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig

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


def gemm_flops_per_token(model_cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token of everything but the router (the part the sweep keeps fixed)."""

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

    plans, flops = {}, {}
    for p in points:
        try:
            cfg = load_config(list(p.overrides))
            plans[p.name] = prepare_run(cfg, world_size_of(cfg))
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

    ck = latest_checkpoint(point.run_dir)
    if ck is None:
        return "new"
    return "finished" if int(read_state(ck)["step"]) >= plan.steps else "partial"


def set_aside_unresumable(point: Point) -> Path | None:
    """A point killed before its first checkpoint left metrics but nothing to resume from: move its run dir
    to ``<run_dir>.stale-<time>`` so the point starts again. Returns the new path, or None."""

    rd = Path(point.run_dir)
    if rd.exists() and (rd / "metrics.jsonl").exists() and latest_checkpoint(rd) is None:
        dest = rd.with_name(f"{rd.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
        rd.rename(dest)
        return dest
    return None


def _run_point(point: Point) -> int:
    """``k2-train <point overrides>`` in a child forked from this process (which imported the trainer once
    for every point: :func:`k2.launcher.training.fork_ranks.preimport`); SIGTERM/SIGUSR1/SIGINT sent to
    the sweep are passed on to it (so a killed sweep stops its point with a checkpoint instead of
    orphaning it), and the child dies with the sweep. Returns the point's exit status."""
    return fork_ranks.launch(1, ["-m", "k2.launcher.train", *point.overrides], rank_env=False)


def run_sweep(overrides: Sequence[str]) -> int:
    """``k2-train -m ...``: validate all points, then run the unfinished ones one after another.

    Returns:
        0 when every point finished; the failing point's exit status otherwise (42 = preempted: re-run
        the same command to continue); 2 for a config error (nothing ran).
    """

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
    if any(s != "finished" for s in status.values()):
        fork_ranks.preimport()  # once for all the points (~8 s of CPU each otherwise)
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
