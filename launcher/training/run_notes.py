"""What ``k2-train`` says on the console when a run starts and when it ends, besides its step lines (the
trainer prints them through the metrics logger: rank 0 only). At the start: the layout and schedule, the
records set aside, the checkpoint resumed and the steps re-run, which optimizer the parameters get (the whole
table in ``<run.dir>/optimizer_params.txt``), and the phase of the first step or that there is nothing to do;
at the end: the steps run, the tokens, the wall time, the last validation loss and where every output is.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from k2.launcher.training.metrics import REPLAYED_METRICS
from k2.optim.params import ParamRoute, format_route_table, route_table

if TYPE_CHECKING:
    from k2.config.schema import OptimConfig
    from k2.launcher.training.prepare import RunPlan

__all__ = ["OPTIMIZER_PARAMS", "startup_lines", "summary_text", "write_route_table"]

#: the file of ``run.dir`` that lists the optimizer of every parameter of the model
OPTIMIZER_PARAMS = "optimizer_params.txt"


def write_route_table(run_dir: Path, routes: Iterable[ParamRoute]) -> str:
    """Write the optimizer of every parameter (``routes``: every rank's) to ``<run_dir>/optimizer_params.txt``;
    returns the table (:func:`k2.optim.params.format_route_table`, its last line the totals)."""
    table = format_route_table(route_table(routes))
    (run_dir / OPTIMIZER_PARAMS).write_text(table + "\n")
    return table


def startup_lines(
    plan: RunPlan,
    *,
    world_size: int,
    n_params: int,
    run_dir: Path,
    start: int,
    replayed_until: int,
    notes: list[str],
    resumed_note: str | None,
    optim: OptimConfig,
    table: str | None,
    first_phase: str,
) -> list[str]:
    """The start-up lines, in order.

    Args:
        plan: the run's plan; world_size: ranks; n_params: rank 0's parameters (elements); run_dir: ``run.dir``.
        start: the step the run continues from (0: fresh); replayed_until: the last step re-run (``start``:
            none).
        notes: lines already written (records set aside, the checkpoint taken instead of ``latest``).
        resumed_note: what was resumed, or None.
        optim: ``cfg.optim``; table: the route table (:func:`write_route_table`; None: not rank 0), said in one
            line on a fresh start.
        first_phase: the description of the phase of step ``start + 1``.
    """
    d = plan.dims
    lines = [
        f"k2-train: world={world_size} PP={d.pp} VPP={d.vpp} EP={d.ep} DP={d.dp}; "
        f"schedule={plan.schedule.name}: {plan.steps} steps x {plan.tokens_per_step:,} tokens; "
        f"rank-0 params={n_params:,}; run.dir={run_dir}",
        *notes,
    ]
    if resumed_note:
        replayed = (
            f"; steps {start + 1}..{replayed_until} are re-run (their earlier records moved to {REPLAYED_METRICS})"
            if replayed_until > start
            else ""
        )
        lines.append(f"k2-train: {resumed_note}{replayed}")
    if table is not None and not start:  # one line: the table is in the file
        lines.append(
            f"optimizer {optim.name} (qk_clip_tau={optim.qk_clip_tau}): "
            f"{table.splitlines()[-1]}; per parameter: {run_dir / OPTIMIZER_PARAMS}"
        )
    if start >= plan.steps:
        lines.append(
            f"k2-train: the checkpoint is at step {start}, the run ends at step "
            f"{plan.steps} (train.iters / the schedule): nothing to do"
        )
    else:
        lines.append(f"step {start + 1}: {first_phase}")
    return lines


def summary_text(
    plan: RunPlan,
    *,
    ending: str,
    last: int,
    consumed_tokens: int,
    seconds: float,
    val_loss: float | None,
    run_dir: Path,
    latest: str,
    goodput: str,
    wandb_mode: str,
) -> str:
    """The end-of-run summary (finished or preempted), several lines.

    Args:
        plan: the run's plan (the steps run are ``plan.resume_step + 1 .. last``); ending: how the run ended
            (``done``, ``stopped for preemption``, ...); last: the last step trained; consumed_tokens: tokens
            trained in total; seconds: wall time of this start; val_loss: the last validation loss, or None;
            run_dir: ``run.dir``; latest: the name of this run's latest checkpoint (``none``); goodput: the
            wall-time split's line (:meth:`k2.launcher.training.goodput.GoodputClock.summary`);
            wandb_mode: ``run.wandb.mode``.
    """
    first = plan.resume_step + 1
    ran = max(0, last - first + 1)
    wandb_dir = run_dir / "wandb" if wandb_mode != "disabled" else None
    lines = [
        f"k2-train: {ending}: {ran} steps run" + (f" ({first}..{last})" if ran else "") + f" of {plan.steps}, "
        f"{consumed_tokens:,} tokens in total, "
        f"{seconds:.1f} s wall time" + (f", final val_loss {val_loss:.4f}" if val_loss is not None else ""),
        f"  metrics:     {run_dir / 'metrics.jsonl'}",
        f"  checkpoints: {run_dir / 'checkpoints'} (latest: {latest})",
        f"  {goodput}",
        f"  wandb:       {wandb_dir if wandb_dir is not None else 'off (run.wandb.mode=disabled)'}",
    ]
    return "\n".join(lines)
