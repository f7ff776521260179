"""What of a sparsity sweep's grid (:mod:`k2.launcher.tools.sweep_grid`) is on disk, and ``grid.json``.

* the status of each run: a trunk ``finished`` (a checkpoint at every branch point), ``partial`` or ``new``;
  a cell ``finished`` (``cell.json``, or a checkpoint at its last step), ``partial`` or ``new``;
* the branch points a trunk has lost (its checkpoint there is gone, and resuming the trunk from a later one
  cannot bring it back), and a finished cell whose files the report cannot read (:func:`cell_problem`);
* a finished cell's ``cell.json`` (:func:`write_cell_file`);
* ``grid.json`` (:func:`grid_manifest`), which ``k2-sweep-report`` reads: written only when its content
  changes, and refused when it would relabel runs already trained with other settings
  (:func:`check_stored_grid`).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from k2.config.errors import ConfigError
from k2.launcher.checkpointing.paths import checkpoints_dir, iter_name, latest_checkpoint, read_state
from k2.launcher.tools.sweep_collect import read_records
from k2.launcher.tools.sweep_grid import CELL_FILE, GRID_FILE, Cell, Grid, Trunk


def checkpoint_step(run_dir: Path) -> int:
    """The step of ``run_dir``'s latest checkpoint (0: none)."""
    ck = latest_checkpoint(run_dir)
    return int(read_state(ck)["step"]) if ck is not None else 0


def trunk_status(trunk: Trunk) -> str:
    """``finished`` (a checkpoint at every branch point), ``partial`` (a checkpoint) or ``new``."""
    ck = checkpoints_dir(trunk.run_dir)
    if all((ck / iter_name(s)).is_dir() for s in trunk.branch_steps):
        return "finished"
    return "partial" if latest_checkpoint(trunk.run_dir) is not None else "new"


def cell_status(cell: Cell) -> str:
    """``finished`` (``cell.json``, or a checkpoint at its last step), ``partial`` or ``new``."""
    if (cell.run_dir / CELL_FILE).exists():
        return "finished"
    step = checkpoint_step(cell.run_dir)
    if step >= cell.last_step:
        return "finished"
    return "partial" if step else "new"


def grid_manifest(grid: Grid) -> dict:
    """``grid.json``: the grid's settings and one entry per cell, paths relative to ``sweep.dir``."""

    def rel(p: Path) -> str:
        return os.path.relpath(p, grid.dir)

    return {
        "name": grid.name,
        "topk": grid.topk,
        "global_batch_tokens": grid.global_batch_tokens,
        "reference_arm": f"sparsity_{min(t.sparsity for t in grid.trunks)}",
        "cooldown": grid.cooldown,
        "collapsed_load": grid.collapsed_load,
        "warmup_steps": grid.warmup_steps,
        "cells": [
            {
                "cell": rel(c.run_dir),
                "arm": c.trunk.arm,
                "sparsity": c.trunk.sparsity,
                "experts": c.trunk.experts,
                "size": c.trunk.size,
                "seed": c.trunk.seed,
                "budget_tokens": c.budget_tokens,
                "branch_step": c.branch_step,
                "last_step": c.last_step,
                "trunk_dir": rel(c.trunk.run_dir),
                "run_dir": rel(c.run_dir),
            }
            for c in grid.cells
        ],
    }


def lost_branch_points(trunk: Trunk) -> list[int]:
    """The trunk's branch points without their checkpoint at or before its latest checkpoint: resuming the
    trunk goes on from that later checkpoint, so those branch points never come back (their branches can
    only start once the trunk is trained again)."""
    latest = checkpoint_step(trunk.run_dir)
    ck = checkpoints_dir(trunk.run_dir)
    return [s for s in trunk.branch_steps if s <= latest and not (ck / iter_name(s)).is_dir()]


def _metrics_problem(path: Path) -> str | None:
    """Why ``metrics.jsonl`` of a finished cell cannot be read as the report reads it
    (:func:`k2.launcher.tools.sweep_collect.read_records`, a finished cell's; None: it can)."""
    try:
        records, _ = read_records(path, path.name, finished=True)
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot be read ({getattr(e, 'strerror', None) or e})"
    except ValueError as e:  # (names the line: a record cut mid-line, or one without an integer 'step')
        return str(e)
    if not records or records[-1].get("val_loss") is None:
        return "its last record has no val_loss"
    return None


def cell_problem(cell: Cell, with_cell_file: bool = True) -> str | None:
    """``<file>: <what is wrong>`` for a finished cell whose files the report cannot read (None: readable):
    ``config.yaml`` missing, ``metrics.jsonl`` with a bad line or no final validation loss, ``cell.json``
    (unless ``with_cell_file`` is false) not a finished cell's JSON object."""
    d = cell.run_dir
    if not (d / "config.yaml").is_file():
        return f"{d / 'config.yaml'}: missing"
    why = _metrics_problem(d / "metrics.jsonl")
    if why:
        return f"{d / 'metrics.jsonl'}: {why}"
    if with_cell_file:
        try:
            info = json.loads((d / CELL_FILE).read_text())
        except (OSError, ValueError) as e:
            return f"{d / CELL_FILE}: not valid JSON ({type(e).__name__})"
        if not isinstance(info, dict) or info.get("status") != "finished" or "wall_clock_s" not in info:
            return f"{d / CELL_FILE}: not a finished cell's record (status, wall_clock_s)"
    return None


def write_grid_manifest(grid: Grid) -> Path:
    """Write ``grid.json`` (atomically) into ``sweep.dir`` unless it already holds that content; returns its
    path.

    Raises:
        ConfigError: the directory or the file cannot be written (naming the directory).
    """
    path = grid.dir / GRID_FILE
    text = json.dumps(grid_manifest(grid), indent=1) + "\n"
    try:
        if path.is_file() and path.read_text() == text:
            return path
    except (OSError, UnicodeDecodeError):
        pass
    tmp = path.with_name(path.name + ".tmp")
    try:
        grid.dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise ConfigError(
            f"sweep.dir={grid.dir}: cannot write {path.name} there ({e.strerror}); allowed: a directory this user "
            "can write (sweep.dir=...)"
        ) from None
    return path


#: the settings grid.json records that change a run once trained: (the key(s) in grid.json, the setting,
#: whether it changes the trunks too (else only the cooldown branches))
_STORED: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("cooldown", "style"), "sweep.cooldown.style", False),
    (("cooldown", "lr_end"), "sweep.cooldown.lr_end", False),
    (("cooldown", "fraction"), "sweep.cooldown.fraction", True),
    (("topk",), "model.moe_router_topk", True),
    (("global_batch_tokens",), "schedule.global_batch_tokens", True),
    (("warmup_steps",), "schedule.phases (the warmup's last step)", True),
    (("largest_budget",), "sweep.budgets_tokens (its largest sets data.index_tokens, every run's data order)", True),
)


def _stored_settings(manifest: dict) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for keys, _, _ in _STORED:
        if keys == ("largest_budget",):
            budgets = [c.get("budget_tokens") for c in manifest.get("cells", []) if isinstance(c, dict)]
            out[keys] = max((b for b in budgets if isinstance(b, int)), default=None)
            continue
        v: Any = manifest
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        out[keys] = v
    return out


def check_stored_grid(grid: Grid) -> None:
    """Refuse a grid whose ``grid.json`` would relabel runs already trained: a setting it records (the
    cooldown, top-k, the global batch, the warmup, the largest budget) that differs from the stored
    ``grid.json`` while some run it changes (a cell, or for the trunk's settings also a trunk) has a
    checkpoint or ``cell.json``. No stored (or no readable) ``grid.json``: nothing to compare.

    Raises:
        ConfigError: naming the setting, the stored and the new value, a run it would relabel, and the ways on.
    """
    path = grid.dir / GRID_FILE
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(stored, dict):
        return
    old, new = _stored_settings(stored), _stored_settings(grid_manifest(grid))
    changed = [(s, keys, trunks_too) for keys, s, trunks_too in _STORED if old[keys] != new[keys]]
    if not changed:
        return
    cells = [c.run_dir for c in grid.cells if cell_status(c) != "new"]
    trunks = [t.run_dir for t in grid.trunks if latest_checkpoint(t.run_dir) is not None]
    for setting, keys, trunks_too in changed:
        trained = cells + (trunks if trunks_too else [])
        if trained:
            raise ConfigError(
                f"{setting}: {old[keys]!r} in {path}, {new[keys]!r} now, and {len(trained)} run(s) of this grid "
                f"were trained with {old[keys]!r} (e.g. {os.path.relpath(trained[0], grid.dir)}), which grid.json "
                f"would relabel; allowed: {old[keys]!r} again, a new sweep.name, or delete those runs' "
                "directories to retrain them"
            )


def _records(run_dir: Path) -> list[dict]:
    out = []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a torn last record of a killed run
                continue
    return out


def _machine(threads: str | None) -> dict:
    """The CPU that finished a cell (``/proc/cpuinfo``'s model name), its cores, the threads per run."""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), None)
    except OSError:
        cpu = None
    return {
        "cpu": cpu or platform.processor(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": threads,
        "host": platform.node(),
    }


def write_cell_file(cell: Cell, peak_rss_bytes: int | None, threads: str | None = None) -> dict:
    """``cell.json`` of a finished cell: its own wall-clock and the trunk's up to the branch point (from the
    runs' goodput clocks in ``metrics.jsonl``), its process's peak resident memory, its final loss."""
    recs = _records(cell.run_dir)
    at_branch = next((r for r in recs if r.get("step") == cell.branch_step), {})
    last = recs[-1] if recs else {}
    trunk_s = at_branch.get("time_total_s")
    info = {
        "status": "finished",
        "tokens": last.get("consumed_tokens"),
        "final_val_loss": last.get("val_loss"),
        "wall_clock_s": (last["time_total_s"] - trunk_s) if trunk_s and "time_total_s" in last else None,
        "trunk_wall_clock_s": trunk_s,
        "peak_rss_bytes": peak_rss_bytes,
        "machine": _machine(threads),
    }
    tmp = cell.run_dir / (CELL_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, cell.run_dir / CELL_FILE)
    return info
