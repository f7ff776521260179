"""The run's position: what a checkpoint records besides the model and optimizer tensors.

:class:`TrainState` owns it and is what the trainer saves and restores (``k2_state.json`` in every
checkpoint, :mod:`k2.launcher.checkpointing`): the optimizer step, the schedule position (tokens
consumed, through the LR scheduler), the data position (global batch ``j`` of a context stretch reads
samples ``[j G, (j + 1) G)``), the layout and optimizer the tensors were written with, and the wandb run
that the metrics continue.

``k2_state.json`` keys: ``step``, ``consumed_tokens``, ``phase``, ``consumed_samples_in_context`` (of the
phase's blend at its sequence length), ``data_path`` (the prefixes of that blend), ``data_fingerprint``
(prefix -> :func:`k2.launcher.datasets.fingerprint.dataset_fingerprint`),
``seq_length``, ``scheduler`` (:meth:`k2.schedules.lr.TokenLRScheduler.state_dict`), ``layout`` (``pp``,
``vpp``, ``ep``, ``dp``, ``world_size``), ``optimizer`` (``k2.optim.name``), ``optimizer_dp_fixed`` (True for
MuonClip's layer-wise ZeRO-1, whose state resumes only at the same DP size), ``wandb_run_id``; the
checkpoint manager (:mod:`k2.launcher.checkpointing.manager`) adds ``reason`` and the other registered
parts under their names: ``goodput`` (the run's wall-time split so far, :mod:`k2.launcher.training.goodput`)
and ``spike`` (the loss-spike window, :mod:`k2.launcher.training.spike`).
"""

from __future__ import annotations

from dataclasses import dataclass

from k2.launcher.datasets.fingerprint import dataset_fingerprint
from k2.launcher.training.phase_data import PhaseData
from k2.schedules.lr import TokenLRScheduler

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """The position of one run (the same on every rank).

    Attributes:
        scheduler: tokens consumed and the LR of the next step.
        data: the current phase's datasets and where in them the next step reads.
        layout: ``{"pp", "vpp", "ep", "dp", "world_size"}`` of this run.
        optimizer: ``k2.optim.name``.
        optimizer_dp_fixed: the optimizer state can only be resumed at the same DP size.
        step: optimizer steps completed (0 before the first).
        wandb_run_id: the wandb run the metrics go to (None: not started yet, or wandb disabled).
    """

    scheduler: TokenLRScheduler
    data: PhaseData
    layout: dict
    optimizer: str
    optimizer_dp_fixed: bool
    step: int = 0
    wandb_run_id: str | None = None

    @property
    def consumed_tokens(self) -> int:
        """Tokens trained on (the schedule position, counted by the LR scheduler)."""
        return self.scheduler.consumed_tokens

    def state_dict(self) -> dict:
        """The top level of ``k2_state.json`` (module docstring) after step :attr:`step`."""
        phase = self.data.phase
        return {
            "step": self.step,
            "consumed_tokens": self.scheduler.consumed_tokens,
            "phase": phase.name,
            "consumed_samples_in_context": self.data.samples_before
            + (self.step - self.data.first_step + 1) * phase.global_batch_size,
            "data_path": self.data.data.train_blend[0],
            # what resume compares (k2.launcher.training.resume_data): the contents, not the path strings
            "data_fingerprint": {p: dataset_fingerprint(p) for p in self.data.data.train_blend[0]},
            "seq_length": phase.seq_length,
            "scheduler": self.scheduler.state_dict(),
            "layout": self.layout,
            "optimizer": self.optimizer,
            "optimizer_dp_fixed": self.optimizer_dp_fixed,
            "wandb_run_id": self.wandb_run_id,
        }

    def load_state_dict(self, saved: dict | None) -> None:
        """Continue from a checkpoint's record: the step, the schedule position and the wandb run (the
        data position follows from the step when the phase is entered)."""
        assert saved is not None, "the run's position is the top level of every k2_state.json"
        self.scheduler.load_state_dict(saved["scheduler"])
        self.step = int(saved["step"])
        self.wandb_run_id = saved.get("wandb_run_id")
