"""The deterministic order global batch -> DP rank -> microbatch (:class:`MicrobatchIterator`).

Units: a sample is one sequence of ``seq_length`` tokens; batch sizes are in samples.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from k2.config.errors import ConfigError


def _collate(samples: Sequence[dict]) -> dict:
    import torch

    out = {}
    for key, first in samples[0].items():
        if first is None:
            continue
        if isinstance(first, torch.Tensor):
            out[key] = torch.stack([s[key] for s in samples])
        elif isinstance(first, np.ndarray):
            out[key] = torch.from_numpy(np.stack([s[key] for s in samples]))
        else:
            out[key] = torch.tensor([s[key] for s in samples])
    return out


class MicrobatchIterator:
    """Deterministic, infinite iterator over this DP rank's microbatches.

    Global batch ``i`` holds dataset samples ``[start + i*GBS, start + (i+1)*GBS)`` (sample numbers
    taken modulo ``len(dataset)``; ``epoch`` counts the wraps). It is cut into ``dp_size`` contiguous
    blocks of ``GBS / dp_size`` samples -- DP rank ``r`` gets block ``r`` -- and each block into
    ``num_microbatches = GBS / (micro_batch_size * dp_size)`` microbatches of ``micro_batch_size``
    samples, yielded in order. The union over DP ranks of one step's microbatches is exactly the
    global batch, for any ``dp_size``. Creating one is O(1) (no prefetch), so a pipeline schedule can
    hold one per model chunk over the same sequence.

    Each microbatch is the dataset's sample dict with every entry stacked on a new leading dim:
    ``tokens``/``labels``/``position_ids`` int64 ``[micro_batch_size, seq_length]``, ``loss_mask``
    float32 ``[micro_batch_size, seq_length]`` (plus whatever else the samples carry).

    Args:
        dataset: indexable, ``len()``-able; items are dicts of tensors (a megatron GPT dataset).
        global_batch_size: samples per optimizer step over all DP ranks (GBS).
        micro_batch_size: samples per forward/backward on one rank.
        dp_rank, dp_size: this rank's data-parallel index and the DP world size.
        start_sample: global sample number of the first global batch (``consumed_samples`` of a
            checkpoint to resume from).

    Attributes:
        num_microbatches: microbatches per global batch on each DP rank.
        consumed_samples: global samples of completed global batches (``start_sample`` + GBS per
            global batch whose last microbatch this iterator has yielded): what to checkpoint.

    Raises:
        ConfigError: GBS not divisible by ``micro_batch_size * dp_size``, or an empty dataset.
        ValueError: non-positive sizes, ``dp_rank`` outside ``[0, dp_size)``, negative start.
    """

    def __init__(
        self,
        dataset: Any,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        start_sample: int = 0,
    ) -> None:
        gbs, mbs, dp = int(global_batch_size), int(micro_batch_size), int(dp_size)
        if gbs <= 0 or mbs <= 0 or dp <= 0:
            raise ValueError(
                f"train.global_batch_size ({gbs}), train.micro_batch_size ({mbs}) and the DP size ({dp}) must be > 0"
            )
        if gbs % (mbs * dp):
            raise ConfigError(
                f"train.global_batch_size={gbs} is not divisible by train.micro_batch_size={mbs} x "
                f"DP size {dp} = {mbs * dp}; make train.global_batch_size a multiple of {mbs * dp} "
                f"(e.g. {max(1, round(gbs / (mbs * dp))) * mbs * dp}) or change train.micro_batch_size"
            )
        if not 0 <= int(dp_rank) < dp:
            raise ValueError(f"dp_rank={dp_rank} outside [0, {dp})")
        if int(start_sample) < 0:
            raise ValueError(f"start_sample={start_sample} must be >= 0")
        self.dataset = dataset
        self.dataset_len = len(dataset)
        if self.dataset_len == 0:
            raise ConfigError("the dataset has no samples (seq_length longer than the data?)")
        self.global_batch_size = gbs
        self.micro_batch_size = mbs
        self.dp_rank = int(dp_rank)
        self.dp_size = dp
        self.local_batch_size = gbs // dp
        self.num_microbatches = gbs // (mbs * dp)
        self.start_sample = int(start_sample)
        self._batch_start = self.start_sample  # first global sample of the current global batch
        self._next_mb = 0  # next microbatch within the current global batch

    @property
    def consumed_samples(self) -> int:
        """Global samples of fully yielded global batches (resume point)."""
        return self._batch_start

    @property
    def global_batches_done(self) -> int:
        """Global batches fully yielded by this iterator."""
        return (self._batch_start - self.start_sample) // self.global_batch_size

    @property
    def epoch(self) -> int:
        """Passes over the dataset completed before the next sample (0 in the first pass)."""
        return self._next_sample() // self.dataset_len

    def _next_sample(self) -> int:
        return self._batch_start + self.dp_rank * self.local_batch_size + self._next_mb * self.micro_batch_size

    def sample_numbers(self, global_batch: int, microbatch: int) -> list[int]:
        """Global (unwrapped) sample numbers of microbatch ``microbatch`` of global batch ``global_batch``
        (counted from ``start_sample``) on this DP rank; dataset index = number % ``len(dataset)``."""
        if not 0 <= microbatch < self.num_microbatches:
            raise IndexError(f"microbatch {microbatch} outside [0, {self.num_microbatches})")
        first = (
            self.start_sample
            + global_batch * self.global_batch_size
            + self.dp_rank * self.local_batch_size
            + microbatch * self.micro_batch_size
        )
        return list(range(first, first + self.micro_batch_size))

    def get(self, global_batch: int, microbatch: int) -> dict:
        """Microbatch ``microbatch`` of global batch ``global_batch`` (random access; no state change)."""
        nums = self.sample_numbers(global_batch, microbatch)
        return _collate([self.dataset[n % self.dataset_len] for n in nums])

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        batch = self.get(self.global_batches_done, self._next_mb)
        self._next_mb += 1
        if self._next_mb == self.num_microbatches:
            self._next_mb = 0
            self._batch_start += self.global_batch_size
        return batch
