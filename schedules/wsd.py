"""K2's training schedule: phases counted in tokens (learning rate, context length, global batch, RoPE).

Source: docs/k2_reference.md "Schedule (WSD), batch and context" (K2 report, section 3.x "Training recipe"):
500 warmup steps to 2e-4, constant 2e-4 to 10T tokens, cosine to 2e-5 at 15.5T, then an anneal
2e-5 -> 7e-6 over 400B tokens at 4K context and 60B at 32K, global batch 67M tokens throughout, weight
decay 0.1, YaRN to 128K as the final setting.

Why our own code (docs/k2_reference.md "Open anchors"): megatron-core's ``OptimizerParamScheduler`` has WSD with
one decay phase counted in iterations or samples. K2 needs several phases counted in *tokens*, an
anneal that continues across a context-length change, the global batch kept constant in tokens while the
sequence length changes, and the RoPE/YaRN setting as part of a phase. Nothing in megatron-core,
Megatron-Bridge or torchtitan expresses that, so this module owns it; the decay curves are megatron's
(same formulas as ``OptimizerParamScheduler.get_lr``).

A schedule (``cfg.schedule``, ``recipes/schedule/``) is a list of phases. Each phase has

* a length: ``tokens`` (length in tokens), ``steps`` (length in optimizer steps of
  ``schedule.global_batch_tokens`` each; for warmup) or ``until_tokens`` (where it ends, counted from the
  start of training) -- exactly one of them; 0 is allowed (the phase is skipped);
* a learning-rate rule ``lr_style`` between ``lr_start`` and ``lr_end``: ``constant``, ``linear`` (warmup
  or decay), ``cosine``, ``exponential``, ``minus_sqrt`` (megatron's WSD decay curves), or ``continue``:
  the previous phase's rule stretched over both phases (K2's anneal runs 2e-5 -> 7e-6 across the 4K and
  the 32K phase);
* ``seq_length`` (context length, tokens), ``rope_type`` (``rope`` | ``yarn``) and ``micro_batch_size``
  (sequences), each defaulting to the previous phase's (the first phase: ``model.rope_type``,
  ``train.micro_batch_size``);
* ``memory``: overrides of ``memory.fp8_store`` / ``recompute`` / ``offload`` from this phase on (each key
  left out = the previous phase's; the first phase starts from the ``memory`` group), e.g. whole-layer
  recompute for K2's 32K anneal; ``k2-train`` switches every one of them at the phase boundary
  (``launcher/training/phase_memory.py``).

Units and rules (all integers are tokens unless named steps):

* ``B = schedule.global_batch_tokens`` tokens per optimizer step, the same in every phase; a phase's
  global batch in sequences is ``B / seq_length`` (must be whole).
* The learning rate is a function of tokens, ``lr_at(t)``, on the phases' *nominal* token boundaries
  (as written in the recipe), so it does not depend on where steps fall, on the sequence length or on a
  resume. Past the end it stays at the last LR.
* Step ``s`` (1-based) trains tokens ``[(s-1)*B, s*B)``. Its LR is ``lr_at(s*B)`` (the tokens consumed
  once it is done: a warmup from 0 gives step 1 a positive LR and the last warmup step exactly the peak).
* **Rounding rule**: step ``s`` belongs to the phase that holds its first token ``(s-1)*B``; so a phase
  boundary at ``T`` tokens lands on the first step boundary at or after ``T``: after step
  ``ceil(T / B)``, at exactly ``ceil(T / B) * B`` tokens (at most ``B - 1`` tokens late). The phase
  before it runs whole steps until it has consumed at least its nominal tokens.
* The run ends with the last step of the last phase, ``ceil(end / B)`` steps (``train.iters`` may cap
  it earlier).

This module holds the resolved objects (:class:`Phase`, :class:`Schedule`) and the decay curves;
:func:`k2.schedules.resolve.resolve_schedule` builds them from ``cfg.schedule`` and checks every rule.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from k2.config.choices import LrStyle, RopeType, values

#: the LR rules a segment runs: every ``schedule.phases.<i>.lr_style`` but ``continue`` (which stretches the
#: previous phase's rule); ``constant`` first, then megatron's decay curves
LR_RULES = tuple(s for s in values(LrStyle) if s != "continue")
PHASE_LENGTH_KEYS = ("tokens", "steps", "until_tokens")


def decay_coefficient(style: str, ratio: float) -> float:
    """Weight of the start value at ``ratio`` in [0, 1] of a segment: LR = end + coeff * (start - end).

    The curves are megatron-core's (``OptimizerParamScheduler.get_lr`` and its WSD decay styles):
    linear ``1 - r``; cosine ``(1 + cos(pi r)) / 2``; exponential ``2 * 0.5**r - 1``; minus_sqrt
    ``1 - sqrt(r)``; constant ``1``.

    Raises:
        ValueError: an unknown style.
    """
    r = min(1.0, max(0.0, float(ratio)))
    if style == "constant":
        return 1.0
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * r) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, r) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(r)
    raise ValueError(f"unknown decay style {style!r}; allowed: {', '.join(LR_RULES)}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Phase:
    """One resolved phase. Token counts are from the start of training.

    Attributes:
        index: position in ``schedule.phases`` (0-based).
        name: the phase's name (``phase`` in metrics.jsonl).
        start_tokens, end_tokens: nominal token range ``[start, end)`` as written in the recipe.
        lr_style: the configured rule (``continue`` = the previous rule goes on).
        lr_start, lr_end: the LR at ``start_tokens`` and at ``end_tokens``.
        seq_length: context length (tokens per sequence).
        rope_type: ``rope`` | ``yarn``.
        micro_batch_size: sequences per microbatch.
        global_batch_size: sequences per step, ``global_batch_tokens / seq_length``.
        first_step, last_step: the 1-based steps the phase runs (rounding rule in the module
            docstring); ``None`` when it gets no step (zero length, or shorter than a step and inside one).
        num_microbatches: per DP rank per step (``None`` when no parallel layout was given or the phase
            gets no step).
        memory: the ``memory.*`` site lists the phase runs with (``{"fp8_store": [...], "recompute": [...],
            "offload": [...]}``: the memory group's, with the overrides of this and earlier phases).
    """

    index: int
    name: str
    start_tokens: int
    end_tokens: int
    lr_style: LrStyle
    lr_start: float
    lr_end: float
    seq_length: int
    rope_type: RopeType
    micro_batch_size: int
    global_batch_size: int
    first_step: int | None
    last_step: int | None
    num_microbatches: int | None = None
    memory: dict | None = None

    @property
    def tokens(self) -> int:
        """Nominal length in tokens."""
        return self.end_tokens - self.start_tokens

    @property
    def steps(self) -> int:
        """Number of optimizer steps the phase runs (0 when skipped)."""
        if self.first_step is None or self.last_step is None:
            return 0
        return self.last_step - self.first_step + 1


@dataclass(frozen=True)
class LRSegment:
    """A stretch of tokens with one LR rule: a phase plus the ``continue`` phases after it."""

    start: int
    end: int
    style: str
    lr_start: float
    lr_end: float

    def lr(self, tokens: float) -> float:
        if self.end <= self.start:
            return self.lr_end
        ratio = (tokens - self.start) / (self.end - self.start)
        return self.lr_end + decay_coefficient(self.style, ratio) * (self.lr_start - self.lr_end)


@dataclass(frozen=True)
class Schedule:
    """A validated schedule (from :func:`resolve_schedule`). See the module docstring for the rules.

    Attributes:
        name: the recipe name (``schedule.name``).
        global_batch_tokens: ``B``, tokens per optimizer step.
        weight_decay: decoupled weight decay applied every step (multiplied by each param group's
            ``wd_mult``).
        phases: every configured phase in order, zero-length ones included.
    """

    name: str
    global_batch_tokens: int
    weight_decay: float
    phases: tuple[Phase, ...]
    _segments: tuple[LRSegment, ...] = field(repr=False, default=())

    # ------------------------------------------------------------------ tokens and steps

    @property
    def end_tokens(self) -> int:
        """Nominal end of the last phase (tokens)."""
        return self.phases[-1].end_tokens

    @property
    def total_steps(self) -> int:
        """Optimizer steps to the end of the last phase: ``ceil(end_tokens / B)``."""
        return ceil_div(self.end_tokens, self.global_batch_tokens)

    @property
    def peak_lr(self) -> float:
        """The largest LR anywhere in the schedule (what megatron's ``OptimizerConfig.lr`` is set to)."""
        return max(max(p.lr_start, p.lr_end) for p in self.phases)

    def boundary_step(self, tokens: int) -> int:
        """The step after which a boundary at ``tokens`` takes effect: ``ceil(tokens / B)``."""
        return ceil_div(int(tokens), self.global_batch_tokens)

    def landed_tokens(self, tokens: int) -> int:
        """Exact token count a boundary at ``tokens`` lands on: ``ceil(tokens / B) * B``."""
        return self.boundary_step(tokens) * self.global_batch_tokens

    def phase_at(self, tokens: int) -> Phase | None:
        """The phase holding token number ``tokens`` (0-based), or ``None`` past the end.

        Zero-length phases hold no token and are never returned.

        Raises:
            ValueError: negative ``tokens``.
        """
        if tokens < 0:
            raise ValueError(f"tokens={tokens} must be >= 0")
        for p in self.phases:
            if p.start_tokens <= tokens < p.end_tokens:
                return p
        return None

    def step_phase(self, step: int) -> Phase | None:
        """The phase step ``step`` (1-based) runs in: the one holding its first token ``(step-1)*B``."""
        if step < 1:
            raise ValueError(f"step={step} must be >= 1")
        return self.phase_at((step - 1) * self.global_batch_tokens)

    def context_steps(self, phase: Phase) -> tuple[int, int]:
        """First and last step of the stretch of consecutive phases that run at ``phase.seq_length``
        (phases that get no step do not interrupt it): the steps one dataset of that sequence length
        serves.

        Raises:
            ValueError: ``phase`` gets no step.
        """
        if phase.first_step is None:
            raise ValueError(f"phase '{phase.name}' runs no step")
        running = [p for p in self.phases if p.first_step is not None]
        i = next(k for k, p in enumerate(running) if p.index == phase.index)
        lo = hi = i
        while lo > 0 and running[lo - 1].seq_length == phase.seq_length:
            lo -= 1
        while hi + 1 < len(running) and running[hi + 1].seq_length == phase.seq_length:
            hi += 1
        first, last = running[lo].first_step, running[hi].last_step
        assert first is not None and last is not None  # (running phases: both set)
        return first, last

    # ------------------------------------------------------------------ learning rate

    def lr_at(self, tokens: float) -> float:
        """The learning rate after ``tokens`` tokens (nominal boundaries; the last LR past the end).

        Raises:
            ValueError: negative ``tokens``.
        """
        if tokens < 0:
            raise ValueError(f"tokens={tokens} must be >= 0")
        segs = [s for s in self._segments if s.end > s.start]
        starts = [s.start for s in segs]
        i = bisect.bisect_right(starts, tokens) - 1
        if i < 0:
            return segs[0].lr_start
        seg = segs[i]
        if tokens >= seg.end:  # past the end of the schedule
            return seg.lr_end
        return seg.lr(tokens)

    def step_lr(self, step: int) -> float:
        """The LR of step ``step`` (1-based): ``lr_at(step * B)``."""
        if step < 1:
            raise ValueError(f"step={step} must be >= 1")
        return self.lr_at(step * self.global_batch_tokens)

    # ------------------------------------------------------------------ reporting

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready description (``k2-plan output=json``, key ``schedule``)."""
        B = self.global_batch_tokens
        phases = []
        for p in self.phases:
            d = {
                "index": p.index,
                "name": p.name,
                "lr_style": p.lr_style,
                "start_tokens": p.start_tokens,
                "end_tokens": p.end_tokens,
                "tokens": p.tokens,
                "lr_at_start": p.lr_start,
                "lr_at_end": p.lr_end,
                "seq_length": p.seq_length,
                "rope_type": p.rope_type,
                "global_batch_size": p.global_batch_size,
                "micro_batch_size": p.micro_batch_size,
                "num_microbatches": p.num_microbatches,
                "memory": p.memory,
                "steps": p.steps,
                "first_step": p.first_step,
                "last_step": p.last_step,
                # where the boundaries land on whole steps (the rounding rule)
                "start_tokens_exact": self.landed_tokens(p.start_tokens),
                "end_tokens_exact": self.landed_tokens(p.end_tokens),
                "lr_first_step": self.step_lr(p.first_step) if p.first_step else None,
                "lr_last_step": self.step_lr(p.last_step) if p.last_step else None,
            }
            phases.append(d)
        return {
            "name": self.name,
            "global_batch_tokens": B,
            "weight_decay": self.weight_decay,
            "total_tokens": self.end_tokens,
            "total_steps": self.total_steps,
            "total_tokens_exact": self.total_steps * B,
            "rounding": (
                "step s trains tokens [(s-1)*B, s*B) and belongs to the phase holding its first token; "
                "a boundary at T tokens lands after step ceil(T/B), at ceil(T/B)*B tokens; the LR of step s "
                "is lr(s*B) on the nominal boundaries"
            ),
            "phases": phases,
        }
