"""``k2-plan``: choose and check a layout for a cluster before spending GPU hours, on a laptop, in seconds.

Example::

    k2-plan model=kimi_k2 parallel=k2_256gpu memory=k2 train.precision=bf16 train.micro_batch_size=1 \\
        plan.optimizer_offload_fraction=1 plot=k2.png            # + output=json, plan.search=true

What it reports: :mod:`k2.launcher.planning.cluster`. Output: tables (``output=text``, the default, or
``table``) or one JSON object on stdout (``output=json``); ``plot=PATH.png`` also draws the per-rank
pipeline timeline there and the LR schedule into ``PATH_schedule.png``. A bad setting prints one line
``k2-plan: error: ...`` to stderr and exits with status 2.
"""

from __future__ import annotations

import json
import sys
from typing import Optional, Sequence

from k2.config import ConfigError, load_config
from k2.launcher.cli import run_main
from k2.launcher.planning.cluster import ClusterPlan, plan_cluster
from k2.launcher.planning.report import format_text
from k2.schedules.pipeline_sim import plot_timeline
from k2.schedules.plot import plot_schedule

PROG = "k2-plan"


def schedule_plot_path(path: str) -> str:
    """Where ``plot=PATH.png`` puts the schedule picture: ``PATH_schedule.png`` next to the timeline."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem}_schedule.{ext}" if dot and "/" not in ext else f"{path}_schedule.png"


def _plot(plan: ClusterPlan, path: str) -> None:

    r = plan.report
    schedule_png = schedule_plot_path(path)
    try:
        plot_timeline(plan.pipeline, path, title=(
            f"{r['model']} on {r['world_size']} GPUs: pp {r['pp']} x vpp {r['vpp']}, "
            f"{r['num_microbatches']} microbatches of {r['micro_batch_size']} x "
            f"{r['seq_length']} tokens, bubble {100 * r['bubble_fraction']:.2f}%"))
        plot_schedule(plan.schedule, schedule_png)
    except OSError as e:
        raise ConfigError(f"plot={path!r}: cannot write the picture ({e})") from None
    print(f"{PROG}: wrote {path} (pipeline timeline) and {schedule_png} (schedule)", file=sys.stderr)


def _plan(args: list[str]) -> int:
    cfg = load_config(args)
    plan = plan_cluster(cfg)
    if cfg.plot:
        _plot(plan, cfg.plot)
    print(json.dumps(plan.report) if cfg.output == "json" else format_text(plan.report))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``k2-plan [HYDRA_OVERRIDE ...]``; 0, or 2 for a bad setting."""
    return run_main(PROG, _plan, argv)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
