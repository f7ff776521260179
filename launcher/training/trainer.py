"""The training loop of one rank: :class:`Trainer` (``k2-train`` runs :func:`run` on every rank).

Flow: :class:`Trainer` builds the run when it is made (``__init__``, in this order): process groups, the
model chunks, DDP, the distributed optimizer, QK-Clip and the LR scheduler
(:func:`k2.launcher.training.setup.setup`); the checkpoint manager over the run's parts; the checkpoint this
run continues from; the metrics. :meth:`Trainer.train` then runs one optimizer step after another in
megatron's pipeline schedule (``get_forward_backward_func``: interleaved 1F1B when ``parallel.vpp > 1``),
each in the schedule phase that holds its first token, with evaluation, preemption and checkpoints at step
boundaries. Checkpoints are the :class:`~k2.launcher.checkpointing.manager.CheckpointManager`'s, the only
door of the trainer to them: the trainer registers its parts with state once and calls it at every step
boundary (torchtitan's ``self.checkpointer.save(step, last_step=...)``); what a checkpoint records besides
the tensors is :class:`TrainState`; what it prints when the run starts and ends is
:mod:`k2.launcher.training.run_notes`; the wall-time split of the run (goodput) is
:mod:`k2.launcher.training.goodput`; the step's record of ``metrics.jsonl`` is
:func:`k2.launcher.training.metrics.step_record`.

The run follows ``plan.schedule`` (:mod:`k2.schedules.wsd`): entering a phase with another sequence length
rebuilds the datasets at that length and runs ``global_batch_tokens / seq_length`` sequences per step
(microbatch count recomputed); entering one with another ``rope_type`` switches every MLA layer's RoPE/YaRN
(:func:`k2.model.rope.set_rope_type`); one with other ``memory.*`` settings (FP8 storage, offload, recompute)
switches them (:mod:`k2.launcher.training.phase_memory`), all through
:class:`k2.launcher.training.phase_switch.PhaseSwitch`; the LR and weight decay of each step come from
:class:`k2.schedules.lr.TokenLRScheduler`. The run ends after ``plan.steps`` steps (the end of the last phase,
or ``train.iters``).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsFloat

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from omegaconf import OmegaConf

from k2.launcher.checkpointing.manager import CheckpointManager
from k2.launcher.datasets.corpus import prepare_stdlib_corpus
from k2.launcher.training.goodput import GoodputClock, process_start_time, set_aside_earlier_start
from k2.launcher.training.hf_export import export_checkpoint
from k2.launcher.training.metrics import MetricsLogger, set_aside_torn_records, step_mfu, step_record
from k2.launcher.training.moe_metrics import moe_step_metrics
from k2.launcher.training.phase_data import PhaseData
from k2.launcher.training.phase_memory import run_memory_options
from k2.launcher.training.phase_switch import PhaseSwitch
from k2.launcher.training.preemption import INTERRUPT_MARKER, REQUEUE_MARKER, Preemption
from k2.launcher.training.prepare import RunPlan
from k2.launcher.training.run_notes import startup_lines, summary_text, write_route_table
from k2.launcher.training.run_report import write_run_report
from k2.launcher.training.setup import setup
from k2.launcher.training.spike import SpikeGuard
from k2.launcher.training.state import TrainState
from k2.launcher.training.step import TrainingDiverged, check_finite, evaluate, reduce_lm_loss, run_microbatches
from k2.launcher.training.watchdog import HangWatchdog, process_group_timeout_s
from k2.model.build import moe_layer_pattern
from k2.model.flops import step_flops
from k2.model.saved_bytes_meter import SavedBytesMeter
from k2.optim.registry import optimizer_spec
from k2.parallel.distributed import DistEnv, init_distributed

if TYPE_CHECKING:
    from k2.config.schema import K2Config
    from k2.schedules.wsd import Phase

__all__ = ["Trainer", "run"]


def run(cfg: K2Config, plan: RunPlan, env: DistEnv) -> dict[str, Any]:
    """Train on this rank (process groups are created here). Returns the last step's metrics record
    (with ``"preempted": <reason>`` when the run stopped for preemption).

    The SIGTERM / SIGUSR1 / SIGINT handlers and the ``run.max_minutes`` clock (:class:`Preemption`) start first
    thing, so a signal during start-up (process groups, model build, checkpoint load) is honoured at the
    first step boundary -- a checkpoint and exit status 42 -- instead of killing the rank with the
    signal's default action, and the budget counts the start-up too.

    Args:
        cfg: a validated config.
        plan: from :func:`k2.launcher.training.prepare.prepare_run` for ``env.world_size``.
        env: this process's rank and world (:func:`k2.parallel.distributed.dist_env`).
    """

    def startup_notice(name: str) -> None:  # (replaced by the metrics logger once it exists)
        if env.rank == 0:
            print(preemption.notice(name, "start-up"), flush=True)

    # (top: k2-train itself runs this one rank, so a second Ctrl-C stops it at once)
    preemption = Preemption(
        cfg.run.max_minutes, on_signal=startup_notice, run_dir=cfg.run.dir, top=not env.launched
    ).install()
    try:
        return Trainer(cfg, plan, env, preemption).train()
    finally:
        preemption.uninstall()


class Trainer:
    """One rank's run: built, with its checkpoint restored and its metrics open, when it is made; then
    trained step by step (:meth:`train` is the outline).

    Args:
        cfg: a validated config; plan: the run's decisions; env: rank and world; preemption: the
            installed signal / wall-time flag, agreed on by all ranks at every step boundary.

    Collective: every rank makes its trainer (process groups are created here) and trains it.
    """

    def __init__(self, cfg: K2Config, plan: RunPlan, env: DistEnv, preemption: Preemption) -> None:
        self.cfg, self.plan, self.env, self.preemption = cfg, plan, env, preemption
        self.run_dir = Path(cfg.run.dir)
        self.record: dict[str, Any] = {}  # the last step's metrics
        self.started = time.perf_counter()  # for the end-of-run summary
        # wall-time split over every start of the run (k2.launcher.training.goodput)
        self.goodput = GoodputClock(process_start_time(parent=env.spawned_by_k2_train))
        self.rank = self._init_process_groups()
        self.watchdog = HangWatchdog.for_run(cfg.run, self.run_dir, self.rank, dist.get_world_size())
        CheckpointManager.verify(plan.resume_from, cfg.checkpoint)  # before the heavy work: damage is refused first
        self._prepare_corpus()
        rope_type = self._phase_of_step(1).rope_type
        # the run's parts; saved-tensor scopes for every phase's memory.* settings (the first phase's: below)
        parts = setup(
            cfg,
            plan.dims,
            plan.schedule,
            rope_type=rope_type,
            memory_switches=run_memory_options(plan.schedule),
            pipeline=True,
            lr_scheduler=True,
        )
        self.tcfg, self.chunks, self.model, self.optimizer = parts.tcfg, parts.chunks, parts.model, parts.optimizer
        self.pipeline, self.qk_clip = parts.pipeline, parts.qk_clip
        self.all_routes = self._gather(parts.routes)  # which optimizer each parameter gets, of every rank
        data_seed = cfg.run.seed if cfg.data.seed is None else cfg.data.seed  # data.seed: null = run.seed
        self.data = PhaseData(
            data_seed, cfg.train.eval_iters, plan, ps.get_data_parallel_rank(), index_tokens=cfg.data.index_tokens
        )
        self.phases = PhaseSwitch(self.data, self.chunks, self.model, self.tcfg, cfg.model, self.pipeline, rope_type)
        # train.measure_saved_bytes: the steps that open a phase
        self.phase_first_steps = {p.first_step for p in plan.schedule.phases if p.first_step}
        placement = optimizer_spec(cfg.optim.name).placement(cfg.optim, cfg.parallel.use_distributed_optimizer)
        assert parts.scheduler is not None  # (lr_scheduler=True)
        self.state = TrainState(parts.scheduler, self.data, plan.layout, cfg.optim.name, placement.layer_wise)
        self.spike = SpikeGuard(cfg.train.spike, self.rank)  # train.spike.*
        self.logger = MetricsLogger(self.run_dir, enabled=self.rank == 0)  # (its records open below)
        # the parts with state, registered once: the run's position, its wall-time split, the loss-spike
        # window (k2_state.json), and the model and optimizer tensors
        self.checkpointer = CheckpointManager(
            config=cfg,
            resume_from=plan.resume_from,
            run_state=self.state,
            clock=self.goodput,
            states={"spike": self.spike},
            model=self.model,
            optimizer=self.optimizer,
            watchdog=self.watchdog,
            log=self.logger.message,
            after_last_save=self._export_at_end,
        )
        self.prepare_run_dir()
        resumed_note = self.checkpointer.restore(env.world_size)
        if self.checkpointer.branch_start:  # a wandb run of its own, not the trunk's continued
            self.state.wandb_run_id = None
        self.forward_backward = self._schedule()
        self._enter_first_phase()
        # steps up to this one are re-run (their earlier records set aside): marked "replayed"
        self.replayed_until = self.open_logger(resumed_note)

    # ------------------------------------------------------------------ the outline

    def train(self) -> dict[str, Any]:
        """Train to ``plan.steps`` (or a preemption) from where the checkpoint left the run; returns the
        last record."""
        preempted = False
        self.goodput.end_startup()
        try:
            self.evaluate_before_training()
            for step in range(self.state.step + 1, self.plan.steps + 1):
                self.preemption.step = step  # named by a signal's log line
                phase = self.enter_phase(step)
                overlapped = self.checkpointer.in_flight_step is not None
                self.record = self.train_step(step, phase)
                if overlapped:  # a background write ran during this step
                    self.record["checkpoint_in_flight"] = True
                self.maybe_evaluate(step, phase)
                self.logger.log({**self.record, **self.goodput.fields()})
                saved = self.checkpointer.maybe_save(step, last_step=step == self.plan.steps)
                # agreed after the periodic save: a signal that arrives while step N saves stops at N
                preempted = step < self.plan.steps and self.stop_for_preemption(step, saved)
                if preempted:
                    break
            self.checkpointer.wait()
            self.summarize(preempted)
        except TrainingDiverged:  # agreed by every rank: the save in flight holds earlier, sound weights
            self.checkpointer.wait()  # (already committed where the error message named it)
            raise
        except BaseException:  # the ranks may not agree on anything any more
            self.checkpointer.abandon()
            raise
        finally:
            self.watchdog.stop()
            self.checkpointer.close()
            self.logger.close()
        if self.cfg.train.report and self.rank == 0:  # the run's curves as PNGs and its summary
            print(write_run_report(self.run_dir).text(), flush=True)
        if preempted:
            self.record["preempted"] = self.preemption.reason
        return self.record

    # ------------------------------------------------------------------ start-up

    def _init_process_groups(self) -> int:
        """Process groups and megatron's parallel state for ``plan.dims``; returns this rank."""
        cfg = self.cfg
        init_distributed(
            self.env,
            self.plan.dims,
            cfg.run.seed,
            rendezvous_timeout_s=cfg.launch.rendezvous_timeout_s,
            timeout_s=process_group_timeout_s(cfg.run),
        )
        return dist.get_rank()

    def _prepare_corpus(self) -> None:
        """The embedded corpus (``data.path`` unset): rank 0 builds it (idempotent), the rest wait."""
        if self.cfg.data.path is None:
            if self.rank == 0:
                prepare_stdlib_corpus(self.cfg.data, progress=False, verbose=not self.env.spawned_by_k2_train)
            dist.barrier()

    @staticmethod
    def _gather(mine: Any) -> list[Any]:
        """Collective: every rank's ``mine``, by rank."""
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone

    def prepare_run_dir(self) -> None:
        """Rank 0: the run dir, its ``config.yaml``; leftovers of a killed save are removed and a branch's
        first start copies the trunk's records up to the branch point (the checkpoint manager's
        :meth:`~k2.launcher.checkpointing.manager.CheckpointManager.prepare`); the requeue and interrupt
        markers of the previous start are removed."""
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.checkpointer.prepare()
            (self.run_dir / "config.yaml").write_text(self.checkpointer.config_yaml)
            for marker in (REQUEUE_MARKER, INTERRUPT_MARKER):
                (self.run_dir / marker).unlink(missing_ok=True)

    def _schedule(self) -> Any:
        """megatron's pipeline schedule (forward-backward over the microbatches of a step); with the
        pipeline hooks, W drained during p2p and the event trace, from the step after the checkpoint."""
        forward_backward = get_forward_backward_func()
        if self.pipeline is not None:
            return self.pipeline.wrap(forward_backward, self.tcfg, self.model, first_step=self.state.step + 1)
        return forward_backward

    def _enter_first_phase(self) -> None:
        """After the restore: enter the phase of the next step (its datasets, RoPE, ``memory.*``)."""
        self.phases.enter(self._phase_after_restore(), self.state.step + 1)

    def open_logger(self, resumed_note: str | None) -> int:
        """Open the metrics (rank 0 writes), and print the start-up lines: the layout, what was resumed,
        which optimizer each parameter gets (also ``<run.dir>/optimizer_params.txt``). Returns the last step
        that is re-run (its earlier record set aside; the checkpoint's step when none is)."""
        cfg, plan, start = self.cfg, self.plan, self.state.step
        replayed_until, fresh_note, torn_notes = start, None, []
        if self.rank == 0:  # records a restart throws away: set aside, their time counted as lost
            torn_notes = set_aside_torn_records(self.run_dir)  # (first: a kill's cut record)
            resumed = start if self.plan.resume_from is not None else None
            replayed_until, fresh_note = set_aside_earlier_start(self.run_dir, resumed, self.goodput)
        config = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(config, dict)
        self.logger.open(
            total_steps=plan.steps,
            wandb_cfg=cfg.run.wandb,
            config=config,
            progress=cfg.train.progress,
            log_interval=cfg.train.log_interval,
            start_step=start,
            wandb_run_id=self.state.wandb_run_id,
        )
        self.state.wandb_run_id = self.logger.wandb_run_id
        n_params = sum(p.numel() for c in self.chunks for p in c.parameters())
        notes = [*torn_notes, fresh_note] if fresh_note else torn_notes
        marker_note = self.checkpointer.latest_note() if self.rank == 0 else None  # latest was not usable
        if marker_note:
            notes.append(f"k2-train: {marker_note}")
        # rank 0: the optimizer of every parameter of the model (all ranks')
        table = write_route_table(self.run_dir, (r for rs in self.all_routes for r in rs)) if self.rank == 0 else None
        for line in startup_lines(
            plan,
            world_size=self.env.world_size,
            n_params=n_params,
            run_dir=self.run_dir,
            start=start,
            replayed_until=replayed_until,
            notes=notes,
            resumed_note=resumed_note,
            optim=cfg.optim,
            table=table,
            first_phase=self.phases.describe(self.data.phase, plan.tokens_per_step),
        ):
            self.logger.message(line)
        self.preemption.on_signal = lambda name: self.logger.message(
            self.preemption.notice(name, f"step {self.preemption.step}")
        )
        return replayed_until

    # ------------------------------------------------------------------ one step

    def evaluate_before_training(self) -> None:
        """A fresh run's validation loss at step 0 (the curve's first point), also a ``"step": 0`` record
        of ``metrics.jsonl``."""
        if self.cfg.train.eval_interval and self.state.step == 0:
            phase = self.data.phase
            with self.goodput.timed("eval"):
                val_loss = self._evaluate(phase)
            self.logger.message(f"step 0: val_loss {val_loss:.4f} (before training)")
            self.logger.log_before_training(
                {
                    "step": 0,
                    "consumed_tokens": 0,
                    "phase": phase.name,
                    "seq_length": phase.seq_length,
                    "val_loss": val_loss,
                }
            )

    def enter_phase(self, step: int) -> Phase:
        """The phase of ``step`` (the one holding its first token); at a boundary, switch datasets, RoPE
        and the ``memory.*`` settings without a restart."""
        phase = self.plan.schedule.phase_at(self.state.consumed_tokens)
        assert phase is not None, step  # (the run ends before the schedule: RunPlan.steps)
        if phase.index != self.data.phase.index:
            self.watchdog.progress("phase", step)  # dataset rebuild: its own allowance
            self.phases.enter(phase, step)
            self.logger.message(f"step {step}: {self.phases.describe(phase, self.plan.tokens_per_step)}")
        return phase

    def train_step(self, step: int, phase: Phase) -> dict[str, Any]:
        """One optimizer step: forward-backward over the global batch, the optimizer, QK-Clip, the LR of
        the next step. Returns the step's metrics record (``metrics.jsonl``)."""
        self.watchdog.progress("step", step)
        t0 = time.perf_counter()
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.spike.before_step(self.model)
        meter = SavedBytesMeter() if self.cfg.train.measure_saved_bytes and step in self.phase_first_steps else None
        with meter.measure(root=False) if meter is not None else contextlib.nullcontext():
            losses = run_microbatches(self.forward_backward, self.data.iters, self.model, phase, forward_only=False)
        loss, _ = reduce_lm_loss(losses)
        update_ok, grad_norm, _ = self.spike.optimizer_step(step, self.optimizer, loss)  # train.spike.action
        attn = self.qk_clip.step(apply=bool(update_ok))  # reads and resets the max-logit windows
        scheduler = self.state.scheduler
        lr = scheduler.lr  # this step's (set before it ran)
        scheduler.step(self.plan.tokens_per_step)
        self.state.step = step
        self._stop_if_diverged(step, lr, loss, grad_norm)
        dt = time.perf_counter() - t0
        self.goodput.add("productive", dt)
        microbatches = phase.num_microbatches
        assert microbatches, phase.name  # (every phase of the run's schedule has its count: RunPlan.schedule)
        saved_bytes = None
        if meter is not None:  # rank 0's layers: kept for backward per microbatch (all its model chunks)
            per = meter.per_forward()
            saved_bytes = (per["device_total"] + per["host_total"]) / microbatches
        m = self.cfg.model
        record = step_record(
            step,
            phase,
            consumed_tokens=self.state.consumed_tokens,
            lr=lr,
            loss=loss,
            grad_norm=grad_norm,
            update_ok=bool(update_ok),
            seconds=dt,
            tokens_per_step=self.plan.tokens_per_step,
            attn=attn,
            # model FLOPs of the step (k2.model.flops, the formula k2-plan uses) over the peak
            mfu=step_mfu(
                step_flops(m, phase.seq_length, self.plan.tokens_per_step),
                dt,
                self.env.world_size,
                self.cfg,
                torch.cuda.is_available(),
            ),
            extra=[
                moe_step_metrics(self.model, m.num_layers, m.num_moe_experts, microbatches, moe_layer_pattern(m)),
                self.pipeline.step_metrics() if self.pipeline is not None else {},
            ],  # wgrad_deferred_peak_bytes
            saved_bytes_per_microbatch=saved_bytes,
            replayed=step <= self.replayed_until,
        )
        self.spike.finish_step(step, record, self.logger.message, self.checkpointer.latest)
        return record

    def maybe_evaluate(self, step: int, phase: Phase) -> None:
        """Validation loss every ``train.eval_interval`` steps and at the last step (into the record)."""
        every = self.cfg.train.eval_interval
        if every and (step % every == 0 or step == self.plan.steps):
            with self.goodput.timed("eval"):
                self.record["val_loss"] = self._evaluate(phase)

    def stop_for_preemption(self, step: int, saved: bool = False) -> bool:
        """Collective: when any rank got SIGTERM / SIGUSR1 / SIGINT (Ctrl-C) or ran out of ``run.max_minutes``,
        save this step (unless ``saved``: its periodic checkpoint was just written), leave the requeue
        marker -- the interrupt marker for Ctrl-C -- (rank 0) and return True on every rank."""
        if not self.preemption.agreed():
            return False
        why = self.preemption.why
        self.checkpointer.wait()
        if saved:
            self.logger.message(f"step {step}: {why}; the checkpoint of this step is the one just written")
        else:  # (committed before save returns: the run stops after it, so the marker says it is saved)
            self.checkpointer.save(step, why)
        if self.rank == 0:  # for launchers that see only "a rank failed" (torchrun, srun's kill)
            self.preemption.leave_marker(self.run_dir, step)
        dist.barrier()  # the marker exists before any rank exits
        return True

    def _export_at_end(self, path: Path, step: int) -> None:
        """After the end-of-run checkpoint is committed: the Hugging Face copy (rank 0)."""
        if self.cfg.checkpoint.export_hf and self.rank == 0:
            self.watchdog.progress("export", step)  # rank 0 alone, for as long as the export takes
            self.logger.message(export_checkpoint(self.run_dir, path, self.cfg.convert.model_type))

    def summarize(self, preempted: bool) -> None:
        """Rank 0, at the end of the run (finished or preempted): steps run, tokens, wall time, the last
        validation loss, and where every output is."""
        if self.rank != 0:
            return
        seconds = time.perf_counter() - self.started
        latest = getattr(self.checkpointer.latest(this_run_only=True), "name", "none")
        summary = summary_text(
            self.plan,
            ending=self._ending(preempted),
            last=self.state.step,
            consumed_tokens=self.state.consumed_tokens,
            seconds=seconds,
            val_loss=self.record.get("val_loss"),
            run_dir=self.run_dir,
            latest=latest,
            goodput=self.goodput.summary(),
            wandb_mode=self.cfg.run.wandb.mode,
        )
        self.logger.message(summary)

    # ------------------------------------------------------------------ helpers

    def _ending(self, preempted: bool) -> str:
        if not preempted:
            return "done"
        return "stopped by Ctrl-C" if self.preemption.reason == "interrupt" else "stopped for preemption"

    def _stop_if_diverged(self, step: int, lr: float, loss: float, grad_norm: SupportsFloat | None) -> None:
        """Every rank raises :class:`TrainingDiverged` for a NaN / inf loss or gradient norm (both global,
        so all ranks stop at the same step), before anything of the step is saved."""
        check_finite(
            step, lr, loss, None if grad_norm is None else float(grad_norm), self.checkpointer.last_sound_checkpoint
        )

    def _phase_after_restore(self) -> Phase:
        """The phase of the next step; for a checkpoint at the schedule's end (which
        :func:`k2.launcher.train` reports as "nothing to do" before any rank starts), the phase of its
        last step, so that a trainer started directly still reaches that message instead of failing."""
        phase = self.plan.schedule.phase_at(self.state.consumed_tokens)
        return phase if phase is not None else self._phase_of_step(max(self.state.step, 1))

    def _phase_of_step(self, step: int) -> Phase:
        """The phase of ``step``, one of the run's (``step <= plan.steps``: the schedule holds it)."""
        phase = self.plan.schedule.step_phase(step)
        assert phase is not None, step
        return phase

    def _evaluate(self, phase: Phase) -> float:
        self.watchdog.progress("eval", self.state.step)
        return evaluate(
            self.cfg.train.eval_iters,
            self.plan,
            phase,
            self.model,
            self.forward_backward,
            self.data.valid_ds,
            self.data.dp_rank,
        )
