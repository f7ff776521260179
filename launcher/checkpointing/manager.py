"""The checkpoint manager: what a run saves, when, and how it continues from a checkpoint.

A run registers its parts once (torchtitan's ``CheckpointManager(states={...})`` is the model):

* the parts whose state is a small JSON record, each a :class:`Stateful` (``state_dict()`` /
  ``load_state_dict()``): the run's position (``run_state``, saved as ``train_state``: step, tokens, LR
  schedule, data position, layout, wandb run), the wall-time split (``clock``, saved as ``goodput``), and the
  other parts by name (the loss-spike window, ``spike``). Together they are the checkpoint's
  ``k2_state.json``: the ``train_state`` record at its top level (the keys that ``k2-train``'s resume
  planning, ``k2-convert`` and people read: ``step``, ``layout``, ...), every other part under its own
  name, and ``reason``, why the checkpoint was written (:class:`~k2.launcher.checkpointing.reasons.SaveReason`);
* the tensors: the model chunks and the optimizer, with the RNG state of every rank, which megatron-core's
  dist-checkpointing writes and reshards (:mod:`k2.launcher.checkpointing.store`,
  :mod:`k2.launcher.checkpointing.loading`).

The loop never decides how a save happens, nor touches a checkpoint's files: before the model is built it
calls :meth:`CheckpointManager.verify` (damage is refused before the heavy work); then, with the manager
built, :meth:`~CheckpointManager.prepare` (rank 0: the run dir), :meth:`~CheckpointManager.restore` once
before the first step, :meth:`~CheckpointManager.maybe_save` once per step boundary,
:meth:`~CheckpointManager.save` to stop there (preemption), :meth:`~CheckpointManager.wait` before it ends;
:meth:`~CheckpointManager.latest` says where the run's weights are. How a checkpoint is written is one of two
strategies of the same path (``checkpoint.async_save``): :class:`SyncSaver` writes and commits it at the
step boundary; :class:`k2.launcher.checkpointing.background.BackgroundSaver` stages it there and commits it
at a later boundary once every rank's writer is done. Both write the same files (a test compares them byte
for byte) through :func:`~k2.launcher.checkpointing.store.begin_save` and
:func:`~k2.launcher.checkpointing.store.commit_save`.

Written as its own module, not torchtitan's or megatron's manager: torchtitan's checkpoints are
``torch.distributed.checkpoint`` of its own parts and megatron-core has no manager, only the
dist-checkpointing calls this one is built on; the visibility protocol, the manifest and the background
writer are k2-launcher's (:mod:`k2.launcher.checkpointing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from k2.config import to_yaml
from k2.config.validate import resume_settings
from k2.launcher.checkpointing.background import BackgroundSaver
from k2.launcher.checkpointing.branch import seed_branch_run_dir
from k2.launcher.checkpointing.loading import load_checkpoint, load_model_weights, verify_checkpoint
from k2.launcher.checkpointing.paths import latest_checkpoint, read_state, resume_point
from k2.launcher.checkpointing.reasons import SaveReason
from k2.launcher.checkpointing.resume import is_branch_start
from k2.launcher.checkpointing.store import remove_partial_saves, save_checkpoint

if TYPE_CHECKING:
    from k2.config.schema import CheckpointConfig, K2Config

__all__ = [
    "CLOCK_STATE",
    "RUN_STATE",
    "CheckpointManager",
    "RunState",
    "SaveReason",
    "Stateful",
    "SyncSaver",
    "load_record",
    "state_record",
]

#: the name of the run's position (``run_state``), whose record is the top level of ``k2_state.json``
RUN_STATE = "train_state"
#: the name the wall-time clock (``clock``) is saved under
CLOCK_STATE = "goodput"


@runtime_checkable
class Stateful(Protocol):
    """A part of a run with state to checkpoint (the protocol of ``torch.distributed.checkpoint.stateful``).

    ``state_dict()`` returns a JSON-able dict (floats round-trip exactly through JSON);
    ``load_state_dict(state)`` continues from it, and accepts None for a checkpoint written before the
    part existed (it then keeps its fresh state).
    """

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict | None) -> None: ...


class RunState(Stateful, Protocol):
    """The run's position (:class:`k2.launcher.training.state.TrainState`): what the manager asks of it."""

    @property
    def step(self) -> int:
        """Optimizer steps completed."""

    @property
    def consumed_tokens(self) -> int:
        """Tokens trained on."""


class Clock(Stateful, Protocol):
    """The run's wall-time split (:class:`k2.launcher.training.goodput.GoodputClock`)."""

    def timed(self, category: str) -> AbstractContextManager[Any]:
        """Count the wall time of the ``with`` body as ``category``."""


class Watchdog(Protocol):
    """The hang watchdog (:class:`k2.launcher.training.watchdog.HangWatchdog`): what the manager tells it."""

    def progress(self, kind: str, step: int | None = None) -> None:
        """A save (``kind="save"``) of ``step`` starts: its allowance applies."""

    def keep_alive(self) -> None:
        """A background writer made progress."""

    def on_hang(self, fn: Callable[[str], None]) -> None:
        """Call ``fn(report_line)`` from the watchdog's thread when the run hangs."""


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
    record["reason"] = str(reason)
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

    in_flight: dict | None = None  # (never a save in flight)

    def __init__(
        self,
        run_dir: Path,
        keep_last: int,
        keep_every: int | None,
        on_commit: Callable[[Path, int, str, float], None],
        on_write_progress: Callable[[], None] | None = None,
        keep_steps: Collection[int] = (),
    ):
        self.run_dir, self.keep_last, self.keep_every = run_dir, keep_last, keep_every
        self.on_commit, self.keep_steps = on_commit, tuple(keep_steps)

    def save(self, step: int, why: str, model: list, optimizer: Any, state: dict, config_yaml: str) -> None:
        """Collective: write and commit checkpoint ``step``, then ``on_commit``.

        Raises:
            CheckpointSaveError: on every rank (one line naming the directory and the rank).
        """
        t0 = time.perf_counter()
        path = save_checkpoint(
            self.run_dir, step, model, optimizer, state, config_yaml, self.keep_last, self.keep_every, self.keep_steps
        )
        self.on_commit(path, step, why, time.perf_counter() - t0)

    def poll(self, blocking: bool = False) -> None:
        """Nothing to commit: every save is committed by :meth:`save`."""

    def abandon(self) -> None:
        """Nothing in flight."""

    def close(self) -> None:
        """Nothing to release."""


class CheckpointManager:
    """Saves and restores one rank's registered parts (module docstring). Keyword arguments only.

    Args:
        config: the run's config: ``run.dir``, ``train.save_interval``, the ``checkpoint`` section
            (``async_save``, ``keep_last``, ``keep_every``, ``save_steps``, ``save_at_end``), ``resume``
            (a branch's first start); the resolved config is written into every checkpoint.
        resume_from: the checkpoint this run continues from (``RunPlan.resume_from``; None: a fresh run).
        run_state: the run's position (saved as :data:`RUN_STATE`).
        clock: the goodput clock, saved as :data:`CLOCK_STATE`; the loop's waits for saves count as its
            ``checkpoint`` time (:meth:`k2.launcher.training.goodput.GoodputClock.timed`).
        states: the other JSON parts, name -> :class:`Stateful`.
        model: the DDP-wrapped model chunks; optimizer: the megatron optimizer.
        watchdog: the hang watchdog: ``progress("save", step)`` before a save or a wait for one,
            ``keep_alive`` while background writers make progress; on a hang, the save in flight is
            abandoned (it stays ``.partial``).
        log: prints a line (rank 0's console).
        after_last_save: ``(path, step)``, after the end-of-run checkpoint is committed and logged (e.g.
            the Hugging Face copy).

    Collective: every method but :meth:`verify`, :meth:`prepare`, :meth:`latest_note`, :meth:`abandon`
    and :meth:`close` runs on every rank at the same step.
    """

    def __init__(
        self,
        *,
        config: K2Config,
        resume_from: Path | None,
        run_state: RunState,
        clock: Clock,
        states: Mapping[str, Stateful],
        model: list,
        optimizer: Any,
        watchdog: Watchdog,
        log: Callable[[str], None],
        after_last_save: Callable[[Path, int], None] | None = None,
    ):
        checkpoint = config.checkpoint
        self.run_dir = Path(config.run.dir)
        self.save_interval = config.train.save_interval
        self.save_at_end = checkpoint.save_at_end
        self.save_steps = frozenset(int(s) for s in checkpoint.save_steps or ())  # checkpoint.save_steps
        self.config_yaml = to_yaml(config)
        self.resume_from = resume_from
        #: the run continues from ``resume.branch_from``'s checkpoint (another run's), at its first start
        self.branch_start = is_branch_start(config, resume_from)
        # the marker note (latest_note) applies where resume=auto chose the checkpoint from run.dir
        self._chose_from_run_dir = resume_settings(config.resume)["from"] is None
        self.run_state = run_state
        self.states: dict[str, Stateful] = {RUN_STATE: run_state, CLOCK_STATE: clock}
        for name, part in states.items():
            if name in self.states:
                raise ValueError(f"state '{name}' is the manager's own ({RUN_STATE}, {CLOCK_STATE})")
            self.states[name] = part
        self.model, self.optimizer = model, optimizer
        self.clock, self.watchdog, self.log = clock, watchdog, log
        self.after_last_save = after_last_save
        self._commits: list[tuple[Path, int, str, float]] = []  # committed, not yet reported (_report)
        strategy = BackgroundSaver if checkpoint.async_save else SyncSaver  # checkpoint.async_save
        self.saver: SyncSaver | BackgroundSaver = strategy(
            self.run_dir,
            checkpoint.keep_last,
            checkpoint.keep_every,
            self._committed,
            watchdog.keep_alive,
            keep_steps=self.save_steps,
        )
        # a hang ends the run without a collective: a background save in flight stays .partial
        watchdog.on_hang(self._abandon_on_hang)

    # ------------------------------------------------------------------ before the first step

    @staticmethod
    def verify(resume_from: Path | None, checkpoint: CheckpointConfig) -> None:
        """Collective, before the model is built (damage is refused before the heavy work): check
        ``resume_from`` (if any) against its manifest at ``checkpoint.verify``
        (:func:`k2.launcher.checkpointing.loading.verify_checkpoint`).

        Raises:
            ConfigError: on rank 0, naming the checkpoint and each damaged file (SystemExit(2) elsewhere).
        """
        if resume_from is not None:
            verify_checkpoint(resume_from, str(checkpoint.verify))

    def prepare(self) -> None:
        """Rank 0, before the metrics open: remove the leftovers of killed saves (``iter_*.partial``); at a
        branch's first start, copy the trunk's records up to the branch point and write ``branch.json``
        (:func:`k2.launcher.checkpointing.branch.seed_branch_run_dir`)."""
        if self.branch_start and self.resume_from is not None:
            seed_branch_run_dir(self.run_dir, self.resume_from, int(read_state(self.resume_from)["step"]))
        remove_partial_saves(self.run_dir)

    def restore(self, world_size: int) -> str | None:
        """Load :attr:`resume_from` (if any) into the model, the optimizer and every registered part; a
        weights-only checkpoint of ``k2-convert import`` loads the model alone (the run starts at step 0
        with a new optimizer state). The RNG state of each rank is restored when ``world_size`` is the
        checkpoint's (else megatron's seeding stands).

        Returns:
            A line saying what was resumed (and, at a branch's first start, where it branched from), or
            None for a fresh run.

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
            return (
                f"initialised from the weights in {path} (imported from {record.get('source')}): "
                "step 0, new optimizer state"
            )
        same_world = record["layout"]["world_size"] == world_size
        load_checkpoint(path, self.model, self.optimizer, same_world=same_world)
        load_record(self.states, record)
        run = self.run_state
        note = (
            f"resumed from {path} (step {run.step}, {run.consumed_tokens:,} tokens"
            f"{'' if same_world else '; world size changed: RNG streams reseeded, not restored'})"
        )
        return f"branched from {path} (step {run.step}): {note}" if self.branch_start else note

    def latest_note(self) -> str | None:
        """Rank 0, after :meth:`restore`: where ``resume=auto`` took the checkpoint from ``run.dir`` with its
        ``latest`` missing, empty or naming nothing, the line saying which checkpoint it took instead
        (:func:`k2.launcher.checkpointing.paths.resume_point`); else None."""
        if self.resume_from is None or not self._chose_from_run_dir:
            return None
        return resume_point(self.run_dir)[1]

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
            reason = SaveReason.SAVE_STEPS if step in self.save_steps else SaveReason.INTERVAL
            self.save(step, SaveReason.END_OF_RUN if last_step else reason)
            return True
        return False

    def save(self, step: int, reason: SaveReason) -> None:
        """Collective: checkpoint ``step`` (tensors and every registered part), visible only once
        complete. A save the run stops after (``reason.stops_run``: the end of the run, a preemption,
        Ctrl-C) is committed before this returns; a background one otherwise at a later step boundary.

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
                self.log(
                    f"step {step}: checkpoint staged in {time.perf_counter() - t0:.2f} s, written in the background"
                )
        self._report()  # a synchronous save: its line (and export) after the stall, as the loop's own work
        if reason.stops_run:  # the run stops here: commit it now
            self.wait()

    def commit_finished(self) -> None:
        """Collective: commit the background save in flight if every rank's writer is done (no wait)."""
        self._poll(blocking=False)

    def wait(self) -> None:
        """Collective: commit the background save in flight, waiting for its writers (the wait counts as
        checkpoint stall and gets the hang watchdog's allowance of a save)."""
        self._poll(blocking=True)

    def latest(self, this_run_only: bool = False) -> Path | None:
        """The newest complete checkpoint of the run, or (unless ``this_run_only``) the one it resumed from
        (None: neither)."""
        own = latest_checkpoint(self.run_dir)
        return own if this_run_only else own or self.resume_from

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

    def _abandon_on_hang(self, _report: str) -> None:
        """The hang watchdog's callback (its thread; no collective): :meth:`abandon`."""
        self.abandon()

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
        """The log line of each checkpoint committed since the last call; after the end-of-run one,
        ``after_last_save``."""
        while self._commits:
            path, step, reason, seconds = self._commits.pop(0)
            self.log(f"step {step}: checkpoint {path} ({reason}, {seconds:.1f} s)")
            if reason == SaveReason.END_OF_RUN and self.after_last_save is not None:
                self.after_last_save(path, step)
