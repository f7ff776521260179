"""Preemption and Ctrl-C: turn SIGTERM / SIGUSR1 / SIGINT on any rank, or a wall-time budget, into one
agreed stop.

Slurm sends USR1 ``--signal=USR1@N`` seconds before the time limit (slurm/pretrain.sbatch) and SIGTERM to
every task on ``scancel`` / ``scontrol requeue`` / preemption; ``k2-train`` run by hand passes SIGTERM on
to its ranks. A handler only sets a flag; at each step boundary :meth:`Preemption.agreed` all-reduces
the flags (MAX) so every rank sees the same answer at the same step, saves the same checkpoint and
exits with :data:`REQUEUE_EXIT_CODE`, which the sbatch script turns into a requeue.

Ctrl-C (SIGINT, to the terminal's process group or to ``k2-train``'s pid) is a person stopping the run:
the first press stops it the same way -- the step in progress ends, a background save in flight is
finished, the step is saved -- and it exits with :data:`INTERRUPT_EXIT` (130, the shell's status for
Ctrl-C; not 42: a Ctrl-C asks for no requeue), rank 0 leaving ``<run.dir>/interrupted`` instead of the
requeue marker. A second press stops at once (:func:`hard_stop`: every process of the run is killed,
one line says what is kept; a save in progress stays ``iter_N.partial``, which the next start removes).
The process at the top counts the presses: ``k2-train``'s own launcher when it spawned the ranks
(:func:`k2.launcher.training.launch.forwarding_signals`), the one rank when it is ``k2-train`` itself; a
rank under a launcher only sets its flag (it may get one press several times: from the terminal and
passed on by its launchers), and torchrun / srun stop their ranks on a repeated Ctrl-C themselves.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from k2.launcher.checkpointing.reasons import SaveReason

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
#: Exit status with which a trainer asks for the job to be requeued (it saved a checkpoint on a signal or
#: at ``run.max_minutes``). The batch script runs ``scontrol requeue $SLURM_JOB_ID`` when ``srun`` returns
#: it; any other status ends the job with it. 42 collides with no status of Python (1, 2), a signal
#: (128+N) or srun's own failures (1, 255).
REQUEUE_EXIT_CODE = 42
#: ``<run.dir>/requeue``: written by rank 0 when the run stopped for preemption (holds the step), so that
#: ``k2-train``'s own launcher can report the requeue exit code although its ranks exit 0 (a launcher
#: treats a non-zero rank as a failure and stops the others). Removed when the next run starts.
REQUEUE_MARKER = "requeue"
#: Exit status of a run stopped by Ctrl-C (SIGINT): after the first press's checkpoint, and after a second
#: press's hard stop (128 + SIGINT, what a shell reports for a program ended by Ctrl-C)
INTERRUPT_EXIT = 130
#: ``<run.dir>/interrupted``: written by rank 0 when the run stopped for Ctrl-C after saving (holds the
#: step), so that ``k2-train``'s launcher exits with :data:`INTERRUPT_EXIT`; removed when the next run starts
INTERRUPT_MARKER = "interrupted"
#: environment variable of every rank forked by k2-train's rank launcher
#: (:mod:`k2.launcher.training.fork_ranks`): the file in which it names a failed rank before it sends
#: the other ranks SIGTERM
PEER_FAILED_ENV = "K2_PEER_FAILED_FILE"
#: the checkpoint reason of each agreed stop (:attr:`Preemption.reason` -> ``k2_state.json``'s ``reason``)
_SAVE_REASONS = {
    "signal": SaveReason.PREEMPTED_SIGNAL,
    "run.max_minutes": SaveReason.PREEMPTED_TIME,
    "interrupt": SaveReason.INTERRUPTED,
}


def peer_failure() -> str | None:
    """In a rank: the line naming the rank whose failure made its launcher stop this one (e.g. ``rank 2
    was killed by signal 9 (SIGKILL)``), or None (not forked by :func:`k2.launcher.training.fork_ranks.launch`,
                                                  or no rank failed)."""
    path = os.environ.get(PEER_FAILED_ENV)
    try:
        return Path(path).read_text().strip() or None if path else None
    except OSError:
        return None


def kept_note(run_dir) -> str:
    """What a run stopped now keeps, for the lines of a stop: the checkpoint ``latest`` names (the next
    start resumes from it), or that there is none; and any save left unfinished (``iter_N.partial``)."""
    from k2.config.errors import ConfigError
    from k2.launcher.checkpointing.paths import PARTIAL_SUFFIX, checkpoints_dir, latest_checkpoint, read_state

    if run_dir is None:  # (a rank that was not told its run dir)
        return "the next start resumes from the run's last checkpoint, if it has one"
    try:
        latest = latest_checkpoint(run_dir)
    except ConfigError:
        latest = None
    if latest is None:
        note = "no checkpoint exists yet: the next start begins at step 1"
    else:
        note = f"kept: {latest} (step {read_state(latest)['step']}): the next start resumes from it"
    root = checkpoints_dir(run_dir)
    partial = sorted(p.name for p in root.glob("*" + PARTIAL_SUFFIX)) if root.is_dir() else []
    if partial:
        note += f"; {', '.join(partial)} is an unfinished save (removed by the next start)"
    return note


def hard_stop(run_dir, what: str) -> None:
    """Stop this process and every process it started at once: SIGKILL to its descendants (ranks, a
    background checkpoint writer, wandb's service; the nearest first, so that a rank launcher is gone
    before its ranks and reports nothing), one line on stderr saying ``what`` and what is kept
    (:func:`kept_note`), then exit :data:`INTERRUPT_EXIT` without Python's teardown (no traceback)."""
    import psutil

    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        descendants = []
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(descendants, timeout=5)
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os.write(
        2,
        f"k2-train: {what}: stopped at once (SIGKILL to {len(descendants)} processes); the step in "
        f"progress is not saved; {kept_note(run_dir)}\n".encode(),
    )
    os._exit(INTERRUPT_EXIT)


class Preemption:
    """Signal flag + wall-time budget of this rank.

    Args:
        max_minutes: ``run.max_minutes`` (None = no budget), counted from construction.
        on_signal: called with the signal name from the handler (logging on rank 0); the attribute
            ``on_signal`` may be replaced later (e.g. once the metrics logger exists). For SIGINT, once.
        run_dir: ``run.dir``, for what a stop keeps (:func:`kept_note`).
        top: this process is the top of the run (``k2-train`` itself, one rank): a second SIGINT stops
            it at once (:func:`hard_stop`). False for a rank under a launcher (module docstring).
    """

    def __init__(self, max_minutes: float | None = None, on_signal=None, run_dir=None, top: bool = False):
        self.signal_name: str | None = None
        #: SIGINT (Ctrl-C) received: the stop is an interruption (exit 130, no requeue)
        self.interrupted = False
        self.run_dir, self.top = run_dir, top
        #: the step in progress (set by the training loop; 0 before the first), for log lines
        self.step = 0
        self.reason: str | None = None
        self._deadline = None if max_minutes is None else time.monotonic() + 60.0 * float(max_minutes)
        self.on_signal = on_signal
        self._previous: dict[int, Any] = {}  # signal -> the handler installed before (restored by uninstall)

    def install(self) -> Preemption:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handler(self, signum, _frame) -> None:
        if signum == signal.SIGINT:
            if self.interrupted:
                if self.top:
                    hard_stop(self.run_dir, "Ctrl-C again")
                return  # (a launcher passed the same press on again)
            self.interrupted = True
        self.signal_name = signal.Signals(signum).name
        if self.on_signal is not None:
            self.on_signal(self.signal_name)

    def notice(self, name: str, during: str) -> str:
        """The log line for signal ``name`` received ``during`` (e.g. ``"step 7"``): a preemption's
        (a checkpoint, then :data:`REQUEUE_EXIT_CODE`), or, when k2-train's rank launcher sent it because
        another rank failed (:func:`peer_failure`), that failure's."""
        peer = peer_failure()
        if peer is not None:
            return (
                f"k2-train: {name} from the rank launcher during {during}: {peer}, so every rank stops; "
                f"the step in progress is not saved; {kept_note(self.run_dir)}"
            )
        when = "after the first step" if during == "start-up" else f"at the end of {during}"
        if name == "SIGINT":
            return (
                f"k2-train: Ctrl-C (SIGINT) during {during}: saving a checkpoint {when} (a background save "
                f"in flight is finished first), then exiting with status {INTERRUPT_EXIT}; Ctrl-C again stops "
                f"at once without saving (now: {kept_note(self.run_dir)})"
            )
        return (
            f"k2-train: {name} received during {during}; saving a checkpoint {when}, then exiting with "
            f"{REQUEUE_EXIT_CODE} (requeue)"
        )

    def local_request(self) -> int:
        """3 when this rank got Ctrl-C, 1 another signal, 2 when its budget ran out, else 0 (the agreed
        reason is the largest: a Ctrl-C wins over a preemption)."""
        if self.interrupted:
            return 3
        if self.signal_name is not None:
            return 1
        if self._deadline is not None and time.monotonic() >= self._deadline:
            return 2
        return 0

    def agreed(self) -> bool:
        """Collective (every rank, same step): True when any rank asks to stop. Sets :attr:`reason`."""
        # (torch imported here: the command-line tools import this module for REQUEUE_EXIT_CODE, and
        # k2-data / k2-submit / the Slurm script's helpers should not pay torch's ~3 s import for it)
        from k2.parallel.distributed import all_reduce_int

        flag = all_reduce_int(self.local_request(), "max")
        if flag:
            self.reason = {1: "signal", 2: "run.max_minutes", 3: "interrupt"}[flag]
        return bool(flag)

    @property
    def why(self) -> SaveReason:
        """The reason of the agreed stop as its checkpoint records it (``preempted: signal``, ``preempted:
        run.max_minutes``, ``interrupted: Ctrl-C (SIGINT)``)."""
        assert self.reason is not None, "no stop agreed yet (agreed() first)"
        return _SAVE_REASONS[self.reason]

    def leave_marker(self, run_dir, step: int) -> None:
        """Rank 0, after the stop's checkpoint: ``<run.dir>/interrupted`` for Ctrl-C, else the requeue
        marker, holding ``step``."""
        name = INTERRUPT_MARKER if self.reason == "interrupt" else REQUEUE_MARKER
        (Path(run_dir) / name).write_text(f"{step}\n")
