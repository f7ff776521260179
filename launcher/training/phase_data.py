"""The datasets and microbatch iterators of the schedule phase a run is in, on one rank."""

from __future__ import annotations

from k2.launcher.datasets.gpt import build_datasets
from k2.launcher.datasets.microbatches import MicrobatchIterator
from k2.launcher.training.prepare import RunPlan

__all__ = ["PhaseData", "microbatch_iterators"]


def microbatch_iterators(dataset, phase, plan: RunPlan, dp_rank: int, start_sample: int = 0) -> list:
    """One :class:`MicrobatchIterator` per model chunk (megatron's interleaved schedule takes one data
    iterator per virtual stage), all over the same samples: ``phase.global_batch_size`` sequences per
    step, ``phase.micro_batch_size`` per microbatch, this DP rank's share, from ``start_sample``."""
    return [
        MicrobatchIterator(dataset, phase.global_batch_size, phase.micro_batch_size, dp_rank,
                           plan.dims.dp, start_sample=start_sample)
        for _ in range(plan.dims.vpp)
    ]


class PhaseData:
    """Datasets and microbatch iterators of the current schedule phase on this rank.

    The datasets are rebuilt (megatron's builder: a collective, every rank enters it at the same step)
    only when the sequence length changes; one build serves the whole stretch of phases at that length
    (``Schedule.context_steps``). Global batch ``j`` of the stretch reads samples ``[j*G, (j+1)*G)`` of
    it (``G`` = the phase's global batch in sequences), so a run resumed at any step reads the same
    samples.

    Args:
        seed: ``run.seed`` (megatron's dataset shuffle seed).
        eval_iters: ``train.eval_iters`` (validation global batches indexed per build).
        plan: the run's plan (datasets, schedule, steps, layout).
        dp_rank: this rank's data-parallel index.

    Attributes:
        phase: the phase served now; first_step: first step of its context stretch; train_ds / valid_ds:
        megatron GPT datasets at the phase's sequence length; iters: one iterator per model chunk.
    """

    def __init__(self, seed: int, eval_iters: int, plan: RunPlan, dp_rank: int):
        self.seed, self.eval_iters, self.plan, self.dp_rank = int(seed), int(eval_iters), plan, dp_rank
        self.phase = None
        self.seq_length = None
        self.first_step = 1
        self.train_ds = self.valid_ds = None
        self.iters = None

    def enter(self, phase, step: int) -> bool:
        """Serve ``phase`` from ``step`` on; returns True when the datasets were rebuilt."""
        rebuilt = False
        if phase.seq_length != self.seq_length:
            first, last = self.plan.schedule.context_steps(phase)
            last = min(last, self.plan.steps)
            self.train_ds, self.valid_ds = build_datasets(
                self.plan.data, phase.seq_length, self.seed,
                train_samples=(last - first + 1) * phase.global_batch_size,
                valid_samples=max(1, self.eval_iters) * phase.global_batch_size,
            )
            self.seq_length, self.first_step, rebuilt = phase.seq_length, first, True
        self.phase = phase
        self.iters = microbatch_iterators(
            self.train_ds, phase, self.plan, self.dp_rank,
            start_sample=(step - self.first_step) * phase.global_batch_size,
        )
        return rebuilt
