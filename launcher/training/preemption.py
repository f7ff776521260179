"""Preemption: turn SIGTERM / SIGUSR1 on any rank, or a wall-time budget, into one agreed stop.

Slurm sends USR1 ``--signal=USR1@N`` seconds before the time limit (slurm/pretrain.sbatch) and SIGTERM to
every task on ``scancel`` / ``scontrol requeue`` / preemption; ``k2-train`` run by hand passes SIGTERM on
to its ranks. A handler only sets a flag; at each step boundary :meth:`Preemption.agreed` all-reduces
the flags (MAX) so every rank sees the same answer at the same step, saves the same checkpoint and
exits with :data:`REQUEUE_EXIT_CODE`, which the sbatch script turns into a requeue.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: Exit status with which a trainer asks for the job to be requeued (it saved a checkpoint on a signal or
#: at ``run.max_minutes``). The batch script runs ``scontrol requeue $SLURM_JOB_ID`` when ``srun`` returns
#: it; any other status ends the job with it. 42 collides with no status of Python (1, 2), a signal
#: (128+N) or srun's own failures (1, 255).
REQUEUE_EXIT_CODE = 42
#: ``<run.dir>/requeue``: written by rank 0 when the run stopped for preemption (holds the step), so that
#: ``k2-train``'s own launcher can report the requeue exit code although its ranks exit 0 (a launcher
#: treats a non-zero rank as a failure and stops the others). Removed when the next run starts.
REQUEUE_MARKER = "requeue"
#: environment variable of every rank forked by k2-train's rank launcher
#: (:mod:`k2.launcher.training.fork_ranks`): the file in which it names a failed rank before it sends
#: the other ranks SIGTERM
PEER_FAILED_ENV = "K2_PEER_FAILED_FILE"


def peer_failure() -> str | None:
    """In a rank: the line naming the rank whose failure made its launcher stop this one (e.g. ``rank 2
    was killed by signal 9 (SIGKILL)``), or None (not forked by :func:`k2.launcher.training.fork_ranks.launch`,
                                                  or no rank failed)."""
    path = os.environ.get(PEER_FAILED_ENV)
    try:
        return Path(path).read_text().strip() or None if path else None
    except OSError:
        return None


class Preemption:
    """Signal flag + wall-time budget of this rank.

    Args:
        max_minutes: ``run.max_minutes`` (None = no budget), counted from construction.
        on_signal: called with the signal name from the handler (logging on rank 0); the attribute
            ``on_signal`` may be replaced later (e.g. once the metrics logger exists).
    """

    def __init__(self, max_minutes: float | None = None, on_signal=None):
        self.signal_name: str | None = None
        #: the step in progress (set by the training loop; 0 before the first), for log lines
        self.step = 0
        self.reason: str | None = None
        self._deadline = None if max_minutes is None else time.monotonic() + 60.0 * float(max_minutes)
        self.on_signal = on_signal
        self._previous = {}

    def install(self) -> Preemption:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handler(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name
        if self.on_signal is not None:
            self.on_signal(self.signal_name)

    def notice(self, name: str, during: str) -> str:
        """The log line for signal ``name`` received ``during`` (e.g. ``"step 7"``): a preemption's
        (a checkpoint, then :data:`REQUEUE_EXIT_CODE`), or, when k2-train's rank launcher sent it because
        another rank failed (:func:`peer_failure`), that failure's."""
        peer = peer_failure()
        if peer is not None:
            return (f"k2-train: {name} from the rank launcher during {during}: {peer}, so every rank stops; "
                    "the step in progress is not saved, the run resumes from its last checkpoint")
        when = "after the first step" if during == "start-up" else f"at the end of {during}"
        return (f"k2-train: {name} received during {during}; saving a checkpoint {when}, then exiting with "
                f"{REQUEUE_EXIT_CODE} (requeue)")

    def local_request(self) -> int:
        """1 when this rank got a signal or its budget ran out, else 0."""
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
            self.reason = {1: "signal", 2: "run.max_minutes"}[flag]
        return bool(flag)
