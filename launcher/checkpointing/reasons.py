"""Why a checkpoint was written: :class:`SaveReason`, recorded as ``reason`` in its ``k2_state.json`` and
named in its log line.

Its own module, without torch: the training loop's signal handling (:mod:`k2.launcher.training.preemption`)
names the reason of a stop, and the command-line tools import that module without paying for torch.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["SaveReason"]


class SaveReason(StrEnum):
    """Why a checkpoint was written; the value is the text ``k2_state.json`` records (``reason``)."""

    #: every ``train.save_interval`` steps
    INTERVAL = "train.save_interval"
    #: a step listed in ``checkpoint.save_steps`` (a sweep's trunk: its branch points)
    SAVE_STEPS = "checkpoint.save_steps"
    #: the last step of the run (``checkpoint.save_at_end``)
    END_OF_RUN = "end of run"
    #: SIGTERM / SIGUSR1 (a scheduler's preemption notice) on any rank
    PREEMPTED_SIGNAL = "preempted: signal"
    #: the run's wall-time budget ``run.max_minutes`` ran out
    PREEMPTED_TIME = "preempted: run.max_minutes"
    #: Ctrl-C
    INTERRUPTED = "interrupted: Ctrl-C (SIGINT)"

    @property
    def stops_run(self) -> bool:
        """The run stops after this save: it is committed before the save returns."""
        return self not in (SaveReason.INTERVAL, SaveReason.SAVE_STEPS)
