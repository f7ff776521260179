"""The datasets and microbatch iterators of the schedule phase a run is in, on one rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k2.launcher.datasets.gpt import build_datasets
from k2.launcher.datasets.microbatches import MicrobatchIterator
from k2.launcher.datasets.resolve import blend_key
from k2.launcher.training.prepare import RunPlan

if TYPE_CHECKING:
    from k2.launcher.datasets.resolve import ResolvedData
    from k2.schedules.wsd import Phase

__all__ = ["PhaseData", "microbatch_iterators"]


def microbatch_iterators(dataset, phase, plan: RunPlan, dp_rank: int, start_sample: int = 0) -> list:
    """One :class:`MicrobatchIterator` per model chunk (megatron's interleaved schedule takes one data
    iterator per virtual stage), all over the same samples: ``phase.global_batch_size`` sequences per
    step, ``phase.micro_batch_size`` per microbatch, this DP rank's share, from ``start_sample``."""
    return [
        MicrobatchIterator(
            dataset, phase.global_batch_size, phase.micro_batch_size, dp_rank, plan.dims.dp, start_sample=start_sample
        )
        for _ in range(plan.dims.vpp)
    ]


class PhaseData:
    """Datasets and microbatch iterators of the current schedule phase on this rank.

    A *stretch* is a run of consecutive phases with the same sequence length and the same data
    (``plan.phase_data``: a phase may name its own blend and validation set); phases that get no step
    do not interrupt it. The datasets are rebuilt (megatron's builder: a collective, every rank enters
    it at the same step) only when a step enters another stretch, without a restart. Each blend keeps
    its own data position: global batch ``j`` of a stretch reads samples ``[o + j*G, o + (j+1)*G)`` of
    its datasets, where ``G`` is the phase's global batch in sequences and ``o`` the samples that earlier
    stretches of the same blend and sequence length read, so a blend that comes back continues where it
    stopped. All of it follows from the step, so a run resumed at any step -- before, at or after a
    switch -- reads the same samples.

    Args:
        seed: ``data.seed`` (null: ``run.seed``), megatron's dataset shuffle seed.
        eval_iters: ``train.eval_iters`` (validation global batches indexed per build).
        plan: the run's plan (datasets, schedule, steps, layout).
        dp_rank: this rank's data-parallel index.
        index_tokens: ``data.index_tokens``: index at least this many training tokens per stretch (megatron
            shuffles the samples over the whole index, whose size therefore decides their order); None =
            the stretch's own.

    Attributes:
        phase: the phase served now; first_step: first step of its stretch; samples_before: ``o`` above;
        data: the :class:`ResolvedData` served now; train_ds / valid_ds: megatron GPT datasets at the
        phase's sequence length; iters: one iterator per model chunk.
    """

    def __init__(self, seed: int, eval_iters: int, plan: RunPlan, dp_rank: int, index_tokens: int | None = None):
        self.seed, self.eval_iters, self.plan, self.dp_rank = int(seed), int(eval_iters), plan, dp_rank
        self.index_tokens = index_tokens
        # the phase served and its data: set by the first enter(), before anything reads them
        self.phase: Phase
        self.data: ResolvedData
        self.key: tuple | None = None
        self.first_step = 1
        self.samples_before = 0
        self.train_ds: Any = None
        self.valid_ds: Any = None
        self.iters: list[MicrobatchIterator] = []

    def phase_data(self, phase: Phase) -> ResolvedData:
        """The :class:`ResolvedData` ``phase`` trains on."""
        return self.plan.phase_data[phase.index] if self.plan.phase_data else self.plan.data

    def _key(self, phase) -> tuple:
        return phase.seq_length, blend_key(self.phase_data(phase))

    def stretches(self) -> list[tuple[tuple, int, int]]:
        """``(key, first step, last step)`` of every stretch up to ``plan.steps``, in order."""
        out: list = []
        for p in self.plan.schedule.phases:
            if p.first_step is None or p.last_step is None or p.first_step > self.plan.steps:
                continue
            last = min(p.last_step, self.plan.steps)
            if out and out[-1][0] == self._key(p):
                out[-1] = (out[-1][0], out[-1][1], last)
            else:
                out.append((self._key(p), p.first_step, last))
        return out

    def enter(self, phase: Phase, step: int) -> bool:
        """Serve ``phase`` from ``step`` on; returns True when the datasets were rebuilt."""
        rebuilt = False
        key = self._key(phase)
        if key != self.key:
            G = phase.global_batch_size
            same = [s for s in self.stretches() if s[0] == key]
            first, last = next((a, b) for _, a, b in same if a <= step <= b)
            self.samples_before = sum(b - a + 1 for _, a, b in same if b < first) * G
            self.data = self.phase_data(phase)
            self.train_ds, self.valid_ds = build_datasets(
                self.data,
                phase.seq_length,
                self.seed,
                train_samples=max(
                    sum(b - a + 1 for _, a, b in same) * G, -(-int(self.index_tokens or 0) // phase.seq_length)
                ),
                valid_samples=max(1, self.eval_iters) * G,
            )
            self.key, self.first_step, rebuilt = key, first, True
        self.phase = phase
        self.iters = microbatch_iterators(
            self.train_ds,
            phase,
            self.plan,
            self.dp_rank,
            start_sample=self.samples_before + (step - self.first_step) * phase.global_batch_size,
        )
        return rebuilt
