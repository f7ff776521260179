"""Everything a training run decides before any process group exists (``k2-train``, ``k2-submit``, the
sweep all call :func:`prepare_run`, so they refuse the same settings)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from k2.config.hardware import peak_tflops
from k2.config.validate import resume_settings
from k2.launcher.checkpointing.paths import read_state
from k2.launcher.checkpointing.resume import plan_resume
from k2.launcher.datasets.resolve import ResolvedData, resolve_data, resolve_phase_data
from k2.launcher.planning import offloads_anything
from k2.launcher.training.resume_data import check_resume_data
from k2.model.backends import check_backend_config
from k2.parallel.dims import ParallelDims
from k2.schedules.pipeline import check_pipeline_config
from k2.schedules.resolve import resolve_schedule
from k2.schedules.wsd import Schedule

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = ["RunPlan", "prepare_run"]


@dataclass(frozen=True)
class RunPlan:
    """The decisions of :func:`prepare_run`.

    Attributes:
        dims: the parallel layout for the world size.
        schedule: per phase seq_length, global batch, microbatches per DP rank, LR rule.
        steps: optimizer steps of this run: the schedule's, capped by ``train.iters``.
        data: the validated data settings.
        tokens_per_step: ``schedule.global_batch_tokens``.
        resume_from: the checkpoint this run continues from, or None for a fresh start.
        resume_step: the last step that checkpoint trained (0 for a fresh start).
        phase_data: the validated data of every schedule phase (by ``Phase.index``): ``data`` unless a
            phase names its own ``schedule.phases.<i>.data``.
    """

    dims: ParallelDims
    schedule: Schedule
    steps: int
    data: ResolvedData
    tokens_per_step: int
    resume_from: Path | None = None
    resume_step: int = 0
    phase_data: tuple = ()

    @property
    def nothing_to_do(self) -> str | None:
        """The line to print when the checkpoint already reaches the run's last step (a finished run run
        again, or ``train.iters`` lowered), else None: such a run starts no rank and exits 0."""
        if self.resume_from is None or self.resume_step < self.steps:
            return None
        total = self.schedule.total_steps
        more = f"train on with a larger train.iters (the schedule runs to step {total}); " if self.steps < total else ""
        return (
            f"the checkpoint {self.resume_from} is at step {self.resume_step}, the run ends at step "
            f"{self.steps} (train.iters / the schedule): nothing to do; {more}to start the run afresh, use a "
            f"new run.dir (or delete {self.resume_from.parent}, the checkpoints of this one)"
        )

    @property
    def ends_before_decay(self) -> str | None:
        """A line for the start of a run that ``train.iters`` stops where the schedule's LR is still above
        where the schedule ends (e.g. before its decay), else None: the weights of such a run are not those
        of the schedule's end, which a short test run may mean but a shortened schedule is made for."""
        total = self.schedule.total_steps
        if self.steps >= total:
            return None
        lr_stop = self.schedule.lr_at(self.steps * self.tokens_per_step)
        lr_end = self.schedule.lr_at(total * self.tokens_per_step)
        if lr_stop <= lr_end:
            return None
        phase = self.schedule.step_phase(self.steps)
        assert phase is not None  # (steps < the schedule's total)
        return (
            f"train.iters={self.steps} ends the run at step {self.steps} of the {total} of schedule "
            f"'{self.schedule.name}', in phase '{phase.name}', at LR {lr_stop:.3g}: the LR does not reach the "
            f"schedule's end ({lr_end:.3g}); to train a shorter run through its decay, shorten the schedule "
            "(schedule.phases.*: steps, tokens, until_tokens) instead"
        )

    @property
    def layout(self) -> dict:
        """``{"pp", "vpp", "ep", "dp", "world_size"}``, as a checkpoint records it."""
        return self.dims.checkpoint_layout()


def prepare_run(cfg: K2Config, world_size: int) -> RunPlan:
    """Check a validated config for ``world_size`` ranks on this machine and decide the run.

    On top of :func:`k2.config.validate.validate` (done by ``load_config``): the pipeline trace path, the
    compute backends this machine can run, the parallel layout, every schedule phase that runs a step
    against megatron's microbatch rule, the data files (of every phase), and the checkpoint to resume from.

    Raises:
        ConfigError: any setting that cannot run, naming the setting and the allowed values.
    """
    check_pipeline_config(cfg.pipeline)
    check_backend_config(cfg)
    peak_tflops(cfg)  # the MFU peak on a GPU: plan.hardware's profile is read (and a bad one named) here
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world_size)
    schedule = resolve_schedule(cfg, dims)
    if offloads_anything(cfg, schedule):
        # imported only here: the planner imports the model (megatron-core), which a run that offloads
        # nothing (and a bad setting) must not wait for
        from k2.launcher.planning import check_host_memory

        check_host_memory(cfg, dims, schedule)
    iters = cfg.train.iters
    steps = schedule.total_steps if iters is None else min(int(iters), schedule.total_steps)
    data = resolve_data(cfg)
    phase_data = resolve_phase_data(cfg, data)
    resume_from = plan_resume(cfg, dims.checkpoint_layout())
    resume_step = 0
    if resume_from is not None:
        state = read_state(resume_from)
        resume_step = int(state["step"])
        check_resume_data(
            resume_from,
            state,
            phase_data,
            [p.name for p in schedule.phases],
            bool(resume_settings(cfg.resume)["force"]),
        )
    return RunPlan(dims, schedule, steps, data, schedule.global_batch_tokens, resume_from, resume_step, phase_data)
