"""A sparsity sweep's grid on a Slurm cluster: what it costs (``k2-plan -m``) and its jobs (``k2-submit -m``).

``k2-plan -m +experiment=...`` plans one run per arm (and size) of the grid with k2-plan's model
(:func:`k2.launcher.planning.plan_cluster`: memory per GPU, the step time on ``plan.hardware``) and prints,
per arm, whether it fits, its peak memory and step time, and the GPU-hours of the grid (each trunk to its last
branch point, each branch's remaining steps) against training every budget as a separate run.

``k2-submit -m +experiment=...`` does the same check (a run that does not fit stops the submission), then
submits one job per unfinished run: each trunk, then each of its branches with ``--dependency=afterok:<the
trunk's job>``, so a branch starts only after its trunk saved every branch point (a branch started without
its trunk's checkpoint stops in one line naming it). Finished runs are not submitted again.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.tools.sweep import check_grid, run_overrides_for_check
from k2.launcher.tools.sweep_grid import Grid, build_grid
from k2.launcher.tools.sweep_state import cell_status, check_stored_grid, trunk_status, write_grid_manifest

_GIB = 2**30


def sweep_costs(grid: Grid) -> list[dict]:
    """Per (arm, size): k2-plan's fit, peak memory per GPU, step time, and the GPU-hours of its seeds' trunks and
    branches against separate runs of every budget (``steps x step time x GPUs``, the main phase's step)."""
    from k2.launcher.planning import plan_cluster

    rows, seen = [], {}
    for trunk in grid.trunks:
        key = (trunk.arm, trunk.size)
        if key not in seen:
            cfg = load_config(run_overrides_for_check(trunk.overrides))
            rep = plan_cluster(cfg).report
            seen[key] = {
                "arm": trunk.arm,
                "size": trunk.size,
                "experts": trunk.experts,
                "fits": bool(rep["fits"]),
                "memory_per_gpu_gib": rep["memory_per_gpu_bytes"]["total"] / _GIB,
                "gpu_memory_gib": rep["gpu_memory_bytes"] / _GIB,
                "gpus": int(rep["world_size"]),
                "step_time_s": float(rep["step_time_s_estimated"]),
                "grid_steps": 0,
                "separate_steps": 0,
            }
            rows.append(seen[key])
        row = seen[key]
        cells = grid.cells_of(trunk)
        row["grid_steps"] += trunk.branch_steps[-1] + sum(c.last_step - c.branch_step for c in cells)
        row["separate_steps"] += sum(c.last_step for c in cells)
    for row in rows:
        per_step = row["step_time_s"] * row["gpus"] / 3600
        row["grid_gpu_hours"] = row["grid_steps"] * per_step
        row["separate_gpu_hours"] = row["separate_steps"] * per_step
    return rows


def format_costs(grid: Grid, rows: list[dict]) -> str:
    """The cost table and the totals (what ``k2-plan -m`` prints)."""
    lines = [
        f"sweep '{grid.name}': {len(grid.trunks)} trunks, {len(grid.cells)} cells "
        f"(budgets {', '.join(f'{b:,}' for b in sorted({c.budget_tokens for c in grid.cells}))} tokens; "
        f"cooldown {grid.cooldown['style']} over the last {grid.cooldown['fraction']:.0%})",
        "| arm | size | experts | fits | GiB per GPU (of) | step s (est.) | GPUs | grid GPU-h | separate GPU-h |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['size'] or '-'} | {r['experts']} | {'yes' if r['fits'] else 'NO'} | "
            f"{r['memory_per_gpu_gib']:.1f} ({r['gpu_memory_gib']:.0f}) | {r['step_time_s']:.2f} | "
            f"{r['gpus']} | {r['grid_gpu_hours']:,.0f} | {r['separate_gpu_hours']:,.0f} |"
        )
    grid_h, sep_h = sum(r["grid_gpu_hours"] for r in rows), sum(r["separate_gpu_hours"] for r in rows)
    lines.append(
        f"total: {grid_h:,.0f} GPU-hours as trunks + cooldown branches, {sep_h:,.0f} as separate runs "
        f"of every budget ({1 - grid_h / sep_h:.0%} saved)"
        if sep_h
        else "total: 0 GPU-hours"
    )
    return "\n".join(lines)


def plan_sweep(overrides: Sequence[str]) -> tuple[Grid, list[dict]]:
    """The grid, checked for the cluster (every run as ``k2-submit`` checks it), and its costs.

    Raises:
        ConfigError: a bad setting, naming the run; a run that does not fit its GPUs.
    """
    _, grid = build_grid(overrides)
    check_stored_grid(grid)
    check_grid(grid, lambda c: c.cluster.nodes * c.cluster.gpus_per_node)
    rows = sweep_costs(grid)
    bad = [r for r in rows if not r["fits"]]
    if bad:
        raise ConfigError(
            "sweep: "
            + "; ".join(
                f"{r['arm']}{'/' + r['size'] if r['size'] else ''} ({r['experts']} experts) needs "
                f"{r['memory_per_gpu_gib']:.1f} GiB per GPU of {r['gpu_memory_gib']:.0f}"
                for r in bad
            )
            + " (k2-plan); allowed: a layout or memory settings that fit (parallel.*, memory.*), or fewer experts"
        )
    return grid, rows


def submit_sweep(overrides: Sequence[str], prog: str = "k2-submit") -> int:
    """``k2-submit -m``: check, print the costs, submit every unfinished run (module docstring).

    Returns:
        0 submitted (or ``submit.dry_run=true``: the scripts on stdout); 1 sbatch failed; 2 a bad setting.
    """
    from k2.launcher.tools.sbatch import check_submittable, render_sbatch, submit_job

    grid, rows = plan_sweep(overrides)
    print(format_costs(grid, rows), file=sys.stderr)
    runs = [(t, grid.cells_of(t)) for t in grid.trunks]
    cfgs = {}
    for t, cells in runs:
        for ovr in [t.overrides, *(c.overrides for c in cells)]:
            cfgs[ovr] = load_config(run_overrides_for_check(ovr))
            check_submittable(cfgs[ovr])
    dry = next(iter(cfgs.values())).submit.dry_run
    write_grid_manifest(grid) if not dry else None
    for t, cells in runs:
        todo = [c for c in cells if cell_status(c) != "finished"]
        if not todo:
            print(f"{prog}: {t.run_dir}: every branch finished, not submitted", file=sys.stderr)
            continue
        trunk_job = None
        if trunk_status(t) != "finished":
            trunk_job = _one(cfgs[t.overrides], t.overrides, (), dry, render_sbatch, submit_job)
            if trunk_job is None:
                return 1
        for c in todo:
            if (
                _one(cfgs[c.overrides], c.overrides, (trunk_job,) if trunk_job else (), dry, render_sbatch, submit_job)
                is None
            ):
                return 1
    return 0


def _one(cfg, overrides, after, dry: bool, render, submit) -> str | None:
    text = render(cfg, list(overrides))
    if dry:
        sys.stdout.write(text + "\n")
        return "DRYRUN"
    return submit(cfg, text, after=after)
