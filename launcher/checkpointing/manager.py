"""The checkpoint manager: what a run saves, when, and how it continues from a checkpoint.

A run registers its parts once (torchtitan's ``CheckpointManager(states={...})`` is the model):

* the parts whose state is a small JSON record, each a :class:`Stateful` (``state_dict()`` /
  ``load_state_dict()``): the run's position (``train_state``: step, tokens, LR schedule, data position,
  layout, wandb run), the wall-time split (``goodput``), the loss-spike window (``spike``). Together they
  are the checkpoint's ``k2_state.json``: the ``train_state`` record at its top level (the keys that
  ``k2-train``'s resume planning, ``k2-convert`` and people read: ``step``, ``layout``, ...), every other
  part under its own name, and ``reason``, why the checkpoint was written;
* the tensors: the model chunks and the optimizer, with the RNG state of every rank, which megatron-core's
  dist-checkpointing writes and reshards (:mod:`k2.launcher.checkpointing.store`).

The loop never decides how a save happens: it calls :meth:`CheckpointManager.maybe_save` once per step
boundary, :meth:`~CheckpointManager.save` to stop there (preemption), :meth:`~CheckpointManager.wait` before
it ends, and :meth:`~CheckpointManager.restore` once before the first step. How a checkpoint is written is
one of two strategies of the same path (``checkpoint.async_save``): :class:`SyncSaver` writes and commits
it at the step boundary; :class:`k2.launcher.checkpointing.background.BackgroundSaver` stages it there and
commits it at a later boundary once every rank's writer is done. Both write the same files (a test
compares them byte for byte) through :func:`~k2.launcher.checkpointing.store.begin_save` and
:func:`~k2.launcher.checkpointing.store.commit_save`.

Written as its own module, not torchtitan's or megatron's manager: torchtitan's checkpoints are
``torch.distributed.checkpoint`` of its own parts and megatron-core has no manager, only the
dist-checkpointing calls this one is built on; the visibility protocol, the manifest and the background
writer are k2-launcher's (:mod:`k2.launcher.checkpointing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from k2.launcher.checkpointing.background import BackgroundSaver
from k2.launcher.checkpointing.paths import latest_checkpoint, read_state
from k2.launcher.checkpointing.store import load_checkpoint, load_model_weights, save_checkpoint

__all__ = ["END_OF_RUN", "RUN_STATE", "CheckpointManager", "Stateful", "SyncSaver", "load_record",
           "state_record"]

#: the registered part whose record is the top level of ``k2_state.json``
RUN_STATE = "train_state"
#: the reason of the save at the end of the run (like ``preempted: ...``, committed before
#: :meth:`CheckpointManager.save` returns: the run stops after it)
END_OF_RUN = "end of run"


@runtime_checkable
class Stateful(Protocol):
    """A part of a run with state to checkpoint (the protocol of ``torch.distributed.checkpoint.stateful``).

    ``state_dict()`` returns a JSON-able dict (floats round-trip exactly through JSON);
    ``load_state_dict(state)`` continues from it, and accepts None for a checkpoint written before the
    part existed (it then keeps its fresh state).
    """

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict | None) -> None: ...


def state_record(states: Mapping[str, Stateful], reason: str) -> dict:
    """The JSON record of ``k2_state.json`` (module docstring): ``states[RUN_STATE]``'s record at the
    top level, every other part under its name, and ``reason``.

    Raises:
        ValueError: no part is registered as :data:`RUN_STATE`, or a part's name is a key of its record.
    """
    if RUN_STATE not in states:
        raise ValueError(f"the checkpoint's states need a '{RUN_STATE}' part; registered: {sorted(states)}")
    record = dict(states[RUN_STATE].state_dict())
    for name, part in states.items():
        if name == RUN_STATE:
            continue
        if name in record:
            raise ValueError(f"state '{name}' would overwrite the key of the same name of '{RUN_STATE}'")
        record[name] = part.state_dict()
    record["reason"] = reason
    return record


def load_record(states: Mapping[str, Stateful], record: dict) -> None:
    """Inverse of :func:`state_record`: each registered part continues from its entry of ``record`` (a
    checkpoint's ``k2_state.json``; a part missing from an older checkpoint gets None)."""
    for name, part in states.items():
        part.load_state_dict(record if name == RUN_STATE else record.get(name))


class SyncSaver:
    """The synchronous strategy: a checkpoint written and committed at the step boundary that asked
    for it (:func:`k2.launcher.checkpointing.store.save_checkpoint`). Offers the methods of
    :class:`~k2.launcher.checkpointing.background.BackgroundSaver`; nothing is ever in flight.

    Args:
        run_dir: ``run.dir``; keep_last / keep_every: ``checkpoint.keep_last`` / ``keep_every``.
        on_commit: ``(path, step, reason, seconds)``, called once the checkpoint is complete.
        on_write_progress: unused (a synchronous write reports its progress to the hang watchdog through
            :func:`k2.launcher.progress.measured`); accepted as the background strategy takes it.
    """

    in_flight = None  # (never a save in flight)

    def __init__(self, run_dir, keep_last: int, keep_every: int | None,
                 on_commit: Callable[[Path, int, str, float], None],
                 on_write_progress: Callable[[], None] | None = None, keep_steps: Collection[int] = ()):
        self.run_dir, self.keep_last, self.keep_every = run_dir, keep_last, keep_every
        self.on_commit, self.keep_steps = on_commit, tuple(keep_steps)

    def save(self, step: int, why: str, model: list, optimizer, state: dict, config_yaml: str) -> None:
        """Collective: write and commit checkpoint ``step``, then ``on_commit``.

        Raises:
            CheckpointSaveError: on every rank (one line naming the directory and the rank).
        """
        t0 = time.perf_counter()
        path = save_checkpoint(self.run_dir, step, model, optimizer, state, config_yaml, self.keep_last,
                               self.keep_every, self.keep_steps)
        self.on_commit(path, step, why, time.perf_counter() - t0)

    def poll(self, blocking: bool = False) -> None:
        """Nothing to commit: every save is committed by :meth:`save`."""

    def abandon(self) -> None:
        """Nothing in flight."""

    def close(self) -> None:
        """Nothing to release."""


class CheckpointManager:
    """Saves and restores one rank's registered parts (module docstring).

    Args:
        run_dir: ``run.dir``.
        checkpoint: the ``checkpoint`` config section (``async_save``, ``keep_last``, ``keep_every``,
            ``save_at_end``).
        save_interval: ``train.save_interval`` (0 / None: no periodic saves).
        states: the JSON parts, name -> :class:`Stateful`; one named :data:`RUN_STATE`.
        model: the DDP-wrapped model chunks; optimizer: the megatron optimizer.
        config_yaml: the resolved config, written into every checkpoint.
        resume_from: the checkpoint this run continues from (None: a fresh run).
        clock: the goodput clock: the loop's waits for saves count as its ``checkpoint`` time
            (:meth:`k2.launcher.training.goodput.GoodputClock.timed`).
        watchdog: the hang watchdog: ``progress("save", step)`` before a save or a wait for one, and
            ``keep_alive`` while background writers make progress.
        log: prints a line (rank 0's logger; looked up when called, so it may be set later).
        after_commit: ``(path, step, reason)``, after a checkpoint is committed and logged (e.g. the
            Hugging Face copy at the end of the run).

    Collective: every method but :meth:`abandon` and :meth:`close` runs on every rank at the same step.
    """

    def __init__(self, run_dir, checkpoint, save_interval: int | None, states: Mapping[str, Stateful],
                 model: list, optimizer, config_yaml: str, resume_from: Path | None, clock, watchdog,
                 log: Callable[[str], None],
                 after_commit: Callable[[Path, int, str], None] = lambda *a: None):
        self.run_dir, self.save_interval = Path(run_dir), save_interval
        self.save_at_end = checkpoint.save_at_end
        self.states, self.model, self.optimizer = dict(states), model, optimizer
        self.config_yaml = config_yaml
        self.resume_from, self.clock, self.watchdog = resume_from, clock, watchdog
        self.log, self.after_commit = log, after_commit
        self._commits: list[tuple[Path, int, str, float]] = []  # committed, not yet reported (_report)
        strategy = BackgroundSaver if checkpoint.async_save else SyncSaver  # checkpoint.async_save
        self.save_steps = frozenset(int(s) for s in checkpoint.save_steps or ())  # checkpoint.save_steps
        self.saver = strategy(self.run_dir, checkpoint.keep_last, checkpoint.keep_every, self._committed,
                              watchdog.keep_alive, keep_steps=self.save_steps)

    # ------------------------------------------------------------------ restore

    def restore(self, world_size: int) -> str | None:
        """Load :attr:`resume_from` (if any) into the model, the optimizer and every registered part; a
        weights-only checkpoint of ``k2-convert import`` loads the model alone (the run starts at step 0
        with a new optimizer state). The RNG state of each rank is restored when ``world_size`` is the
        checkpoint's (else megatron's seeding stands).

        Returns:
            A line saying what was resumed, or None for a fresh run.

        Raises:
            ConfigError: the checkpoint cannot be read or loaded (naming it).
        """
        path = self.resume_from
        if path is None:
            return None
        record = read_state(path)
        if record.get("weights_only"):  # k2-convert import: a fresh run from weights
            load_model_weights(path, self.model)
            self.optimizer.reload_model_params()  # the fp32 master copies follow (megatron's own call)
            return (f"initialised from the weights in {path} (imported from {record.get('source')}): "
                    "step 0, new optimizer state")
        same_world = record["layout"]["world_size"] == world_size
        load_checkpoint(path, self.model, self.optimizer, same_world=same_world)
        load_record(self.states, record)
        tokens = int(record["scheduler"]["consumed_tokens"])  # (where the run's position continues from)
        return (f"resumed from {path} (step {int(record['step'])}, {tokens:,} tokens"
                f"{'' if same_world else '; world size changed: RNG streams reseeded, not restored'})")

    # ------------------------------------------------------------------ saves

    @property
    def in_flight_step(self) -> int | None:
        """The step of the background save being written, or None."""
        flight = self.saver.in_flight
        return flight["step"] if flight is not None else None

    def maybe_save(self, step: int, last_step: bool) -> bool:
        """Once per step boundary, after the step is logged: commit a background save whose writers are
        done, then save ``step`` when it is due -- every ``train.save_interval`` steps, at each step of
        ``checkpoint.save_steps``, and at the last step with ``checkpoint.save_at_end`` (committed before this
        returns). Returns True when it saved."""
        self.commit_finished()
        every = self.save_interval
        if (every and step % every == 0) or step in self.save_steps or (last_step and self.save_at_end):
            reason = "checkpoint.save_steps" if step in self.save_steps else "train.save_interval"
            self.save(step, END_OF_RUN if last_step else reason)
            return True
        return False

    def save(self, step: int, reason: str) -> None:
        """Collective: checkpoint ``step`` (tensors and every registered part), visible only once
        complete. A save the run stops after (``end of run``, ``preempted: ...``) is committed before
        this returns; a background one otherwise at a later step boundary.

        Raises:
            CheckpointSaveError: on every rank; ``latest`` still names the previous checkpoint.
        """
        self.watchdog.progress("save", step)
        t0 = time.perf_counter()
        record = state_record(self.states, reason)
        with self.clock.timed("checkpoint"):
            self.saver.save(step, reason, self.model, self.optimizer, record, self.config_yaml)
            if self.in_flight_step == step:  # staged; committed at a later step boundary
                self._report()  # (a save before it, committed while this one waited for its writers)
                self.log(f"step {step}: checkpoint staged in {time.perf_counter() - t0:.2f} s, "
                         "written in the background")
        self._report()  # a synchronous save: its line (and export) after the stall, as the loop's own work
        if reason.startswith("preempted") or reason == END_OF_RUN:  # the run stops here: commit it now
            self.wait()

    def commit_finished(self) -> None:
        """Collective: commit the background save in flight if every rank's writer is done (no wait)."""
        self._poll(blocking=False)

    def wait(self) -> None:
        """Collective: commit the background save in flight, waiting for its writers (the wait counts as
        checkpoint stall and gets the hang watchdog's allowance of a save)."""
        self._poll(blocking=True)

    def latest(self) -> Path | None:
        """The newest complete checkpoint of the run, or the one it resumed from (None: neither)."""
        return latest_checkpoint(self.run_dir) or self.resume_from

    def last_sound_checkpoint(self) -> Path | None:
        """Collective (every rank, on an agreed divergence): commit the background save in flight (it
        holds earlier, sound weights), then :meth:`latest`."""
        self.wait()
        return self.latest()

    def abandon(self) -> None:
        """No collective (the ranks may not agree any more): kill a background writer in flight; its save
        stays ``.partial`` and ``latest`` keeps naming the previous checkpoint."""
        self.saver.abandon()

    def close(self) -> None:
        """Release the strategy (after :meth:`wait` or :meth:`abandon`)."""
        self.saver.close()

    def _poll(self, blocking: bool) -> None:
        step = self.in_flight_step
        if step is None:
            return
        if blocking:  # the wait for the writers gets the watchdog's allowance of a save
            self.watchdog.progress("save", step)
        with self.clock.timed("checkpoint"):
            self.saver.poll(blocking=blocking)
            self._report()

    def _committed(self, path: Path, step: int, reason: str, seconds: float) -> None:
        """The strategy's ``on_commit``: reported by :meth:`_report` where the loop's time is accounted."""
        self._commits.append((path, step, reason, seconds))

    def _report(self) -> None:
        """The log line of each checkpoint committed since the last call, then ``after_commit``."""
        while self._commits:
            path, step, reason, seconds = self._commits.pop(0)
            self.log(f"step {step}: checkpoint {path} ({reason}, {seconds:.1f} s)")
            self.after_commit(path, step, reason)

