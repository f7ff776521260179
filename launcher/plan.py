"""``k2-plan``: choose and check a layout for a cluster before spending GPU hours, on a laptop, in seconds.

Example::

    k2-plan model=kimi_k2 parallel=k2_256gpu plot=k2.png      # K2's run; + output=json, plan.search=true

What it reports: :func:`k2.launcher.planning.plan_cluster` (the planner's one entry point). Output: tables
(``output=text``, the default, or ``table``) or one JSON object on stdout (``output=json``); ``plot=PATH.png``
also draws the per-rank pipeline timeline into ``PATH.png``, ``plot_schedule=PATH.png`` the LR schedule (either,
both or none). A bad setting prints one line ``k2-plan: error: ...`` to stderr and exits with status 2.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from k2.config import ConfigError, load_config
from k2.launcher.cli import run_main

if TYPE_CHECKING:
    from k2.config.schema import K2Config
    from k2.launcher.planning import ClusterPlan

# the planner, the plots and the data checks are imported where they are used: --help does not wait
# for the model's imports (megatron-core, torch)

PROG = "k2-plan"

USAGE = """usage: k2-plan [HYDRA_OVERRIDE ...]

Check a configuration for a cluster of cluster.nodes x cluster.gpus_per_node GPUs without starting
anything: the layout per pipeline rank, memory per GPU and per phase (fits against
cluster.gpu_memory_gib and, per node, cluster.host_memory_gib), the pipeline bubble, FLOPs and MFU, the
schedule's phases and the data blend of each. output=json prints one JSON object;
plot=PATH.png draws the pipeline timeline, plot_schedule=PATH.png the LR schedule; plan.search=true
ranks every valid layout by the step-time model's estimate (plan.hardware=NAME | PATH.yaml: the hardware
profile, NAME one of those listed below); plan.published=all compares the model with published runs.

examples:
  k2-plan model=kimi_k2 parallel=k2_256gpu cluster.nodes=32 cluster.gpus_per_node=8 output=json
  k2-plan model=kimi_k2 parallel=k2_256gpu cluster.nodes=32 plan.search=true
  k2-plan schedule=k2_15t5 plot_schedule=k2_15t5_schedule.png
  k2-plan plan.published=all
"""


def _plot_timeline(plan: ClusterPlan, path: str) -> None:
    """``plot=PATH``: the per-rank pipeline timeline of the main phase."""
    from k2.launcher.planning import plot_timeline

    r = plan.report
    try:
        plot_timeline(
            plan.pipeline,
            path,
            title=(
                f"{r['model']} on {r['world_size']} GPUs: pp {r['pp']} x vpp {r['vpp']}, "
                f"{r['num_microbatches']} microbatches of {r['micro_batch_size']} x "
                f"{r['seq_length']} tokens, bubble {100 * r['bubble_fraction']:.2f}%"
            ),
        )
    except OSError as e:
        raise ConfigError(f"plot={path!r}: cannot write the picture ({e})") from None
    print(f"{PROG}: wrote {path} (pipeline timeline)", file=sys.stderr)


def _plot_schedule(plan: ClusterPlan, path: str) -> None:
    """``plot_schedule=PATH``: the LR and context length over tokens."""
    from k2.schedules.plot import plot_schedule

    try:
        plot_schedule(plan.schedule, path)
    except OSError as e:
        raise ConfigError(f"plot_schedule={path!r}: cannot write the picture ({e})") from None
    print(f"{PROG}: wrote {path} (schedule)", file=sys.stderr)


def phase_data_rows(cfg: K2Config) -> list[dict]:
    """Per schedule phase: its name and the ``data.path`` / ``data.valid_path`` it trains and validates on
    (null = the embedded corpus; a valid_path of null carves validation out of the path by data.split)."""
    from k2.launcher.datasets.resolve import phase_data_settings

    return [
        {"phase": ph.name, "data_path": path, "valid_path": valid}
        for ph, (path, valid) in zip(cfg.schedule.phases, phase_data_settings(cfg))
    ]


def _format_phase_data(rows: list[dict]) -> str:
    lines = ["data per phase (schedule.phases.<i>.data; null = the embedded corpus):"]
    width = max(len(r["phase"]) for r in rows)
    for r in rows:
        valid = "" if r["valid_path"] is None else f"  valid: {json.dumps(r['valid_path'])}"
        lines.append(f"  {r['phase']:{width}s}  {json.dumps(r['data_path'])}{valid}")
    return "\n".join(lines)


def _plan(args: list[str]) -> int:
    from k2.launcher.planning import format_text, plan_cluster
    from k2.launcher.tools.sweep import split_multirun

    multirun, args = split_multirun(args)
    if multirun:  # a sweep's grid: every arm's fit, and the GPU-hours against separate runs
        from k2.launcher.tools.sweep_submit import format_costs, plan_sweep

        grid, rows = plan_sweep(args)
        print(json.dumps({"sweep": rows}) if load_config(args).output == "json" else format_costs(grid, rows))
        return 0
    cfg = load_config(args)
    if cfg.plan.published:
        from k2.launcher.planning import compare_published, format_published

        rows = compare_published(str(cfg.plan.published))
        print(json.dumps({"published": rows}) if cfg.output == "json" else format_published(rows))
        return 0
    plan = plan_cluster(cfg)
    plan.report["phase_data"] = phase_data_rows(cfg)
    if cfg.plot:
        _plot_timeline(plan, cfg.plot)
    if cfg.plot_schedule:
        _plot_schedule(plan, cfg.plot_schedule)
    if cfg.output == "json":
        print(json.dumps(plan.report))
    else:
        print(format_text(plan.report) + "\n\n" + _format_phase_data(plan.report["phase_data"]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``k2-plan [HYDRA_OVERRIDE ...]``; 0, or 2 for a bad setting."""
    return run_main(PROG, _plan, argv, usage=USAGE)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
