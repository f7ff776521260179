"""K2's training schedule: phases counted in tokens (learning rate, context length, global batch, RoPE).

Source: REFERENCE.md "Schedule (WSD), batch and context" (K2 report, section 3.x "Training recipe"):
500 warmup steps to 2e-4, constant 2e-4 to 10T tokens, cosine to 2e-5 at 15.5T, then an anneal
2e-5 -> 7e-6 over 400B tokens at 4K context and 60B at 32K, global batch 67M tokens throughout, weight
decay 0.1, YaRN to 128K as the final setting.

Why our own code (REFERENCE.md "Open anchors"): megatron-core's ``OptimizerParamScheduler`` has WSD with
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
  ``train.micro_batch_size``).

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
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from launcher.config import ConfigError

__all__ = [
    "LR_STYLES",
    "ROPE_TYPES",
    "Phase",
    "Schedule",
    "decay_coefficient",
    "lr_at_tokens",
    "resolve_schedule",
]

# megatron OptimizerParamScheduler decay curves + "continue" (the previous phase's rule goes on).
LR_STYLES = ("constant", "linear", "cosine", "exponential", "minus_sqrt", "continue")
ROPE_TYPES = ("rope", "yarn")
_LENGTH_KEYS = ("tokens", "steps", "until_tokens")


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
    raise ValueError(f"unknown decay style {style!r}; allowed: {', '.join(LR_STYLES[:-1])}")


def _ceil_div(a: int, b: int) -> int:
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
    """

    index: int
    name: str
    start_tokens: int
    end_tokens: int
    lr_style: str
    lr_start: float
    lr_end: float
    seq_length: int
    rope_type: str
    micro_batch_size: int
    global_batch_size: int
    first_step: Optional[int]
    last_step: Optional[int]
    num_microbatches: Optional[int] = None

    @property
    def tokens(self) -> int:
        """Nominal length in tokens."""
        return self.end_tokens - self.start_tokens

    @property
    def steps(self) -> int:
        """Number of optimizer steps the phase runs (0 when skipped)."""
        return 0 if self.first_step is None else self.last_step - self.first_step + 1


@dataclass(frozen=True)
class _Segment:
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
    _segments: tuple[_Segment, ...] = field(repr=False, default=())

    # ------------------------------------------------------------------ tokens and steps

    @property
    def end_tokens(self) -> int:
        """Nominal end of the last phase (tokens)."""
        return self.phases[-1].end_tokens

    @property
    def total_steps(self) -> int:
        """Optimizer steps to the end of the last phase: ``ceil(end_tokens / B)``."""
        return _ceil_div(self.end_tokens, self.global_batch_tokens)

    @property
    def peak_lr(self) -> float:
        """The largest LR anywhere in the schedule (what megatron's ``OptimizerConfig.lr`` is set to)."""
        return max(max(p.lr_start, p.lr_end) for p in self.phases)

    def boundary_step(self, tokens: int) -> int:
        """The step after which a boundary at ``tokens`` takes effect: ``ceil(tokens / B)``."""
        return _ceil_div(int(tokens), self.global_batch_tokens)

    def landed_tokens(self, tokens: int) -> int:
        """Exact token count a boundary at ``tokens`` lands on: ``ceil(tokens / B) * B``."""
        return self.boundary_step(tokens) * self.global_batch_tokens

    def phase_at(self, tokens: int) -> Optional[Phase]:
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

    def step_phase(self, step: int) -> Optional[Phase]:
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
        return running[lo].first_step, running[hi].last_step

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


# ---------------------------------------------------------------------- resolution / validation


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    if isinstance(node, dict):
        return node.get(key, default)
    return getattr(node, key, default)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fmt(n: int) -> str:
    return f"{n:,}"


def _supported_length(model_cfg: Any, rope_type: str) -> tuple[int, str]:
    """Longest context the model's position settings allow under ``rope_type`` and why."""
    max_pos = int(_get(model_cfg, "max_position_embeddings"))
    if rope_type == "yarn":
        orig = int(_get(model_cfg, "original_max_position_embeddings"))
        factor = float(_get(model_cfg, "rotary_scaling_factor"))
        yarn_max = int(orig * factor)
        if yarn_max < max_pos:
            return yarn_max, (
                f"model.original_max_position_embeddings={orig} x model.rotary_scaling_factor={factor:g}"
            )
    return max_pos, f"model.max_position_embeddings={max_pos}"


def resolve_schedule(cfg: Any, dims: Any = None) -> Schedule:
    """Validate ``cfg.schedule`` against ``cfg.model`` (and the parallel layout) and resolve it.

    Args:
        cfg: the composed config; reads ``schedule``, ``model`` (position settings, ``rope_type``) and
            ``train.micro_batch_size``.
        dims: optional :class:`parallel.dims.ParallelDims`; when given, megatron's microbatch rule
            (:func:`parallel.dims.check_microbatches`) is checked for every phase that runs a step, and
            ``Phase.num_microbatches`` is filled in.

    Returns:
        The :class:`Schedule`.

    Raises:
        ConfigError: naming the setting (``schedule.phases.<i>.<key>``) and the allowed values, for: no
            phases; a phase with none or more than one of tokens/steps/until_tokens; a negative length;
            ``until_tokens`` before the end of the previous phase (phases out of order; a warmup longer
            than the room its neighbour leaves); an unknown ``lr_style``; ``continue`` on the first
            phase or with its own ``lr_start``/``lr_end``; a missing or negative LR; a constant phase with
            ``lr_end != lr_start``; a missing or non-positive ``seq_length``; ``seq_length`` beyond what
            the model's position settings support (plain RoPE: ``model.max_position_embeddings``; YaRN:
            also ``original_max_position_embeddings x rotary_scaling_factor``); an unknown
            ``rope_type``; ``schedule.global_batch_tokens`` not divisible by a phase's ``seq_length``;
            duplicate phase names; a schedule with no tokens; and (with ``dims``) a phase whose global
            batch megatron's pipeline schedule cannot split into microbatches.
    """
    s = cfg.schedule
    B = _get(s, "global_batch_tokens")
    if not _is_int(B) or B < 1:
        raise ConfigError(f"schedule.global_batch_tokens={B!r} must be an integer >= 1 (tokens per step)")
    wd = _get(s, "weight_decay", 0.0)
    if wd is None or float(wd) < 0:
        raise ConfigError(f"schedule.weight_decay={wd!r} must be a number >= 0")
    raw = list(_get(s, "phases") or [])
    if not raw:
        raise ConfigError("schedule.phases is empty; a schedule needs at least one phase "
                          "(see recipes/schedule/)")
    model_cfg = cfg.model
    default_mbs = _get(cfg.train, "micro_batch_size")

    phases: list[dict] = []
    names: set[str] = set()
    end = 0
    prev: Optional[dict] = None
    for i, ph in enumerate(raw):
        key = f"schedule.phases.{i}"
        name = str(_get(ph, "name") or f"phase{i}")
        where = f"{key} ('{name}')"
        if name in names:
            raise ConfigError(f"{key}.name={name!r} is used twice; phase names must be unique")
        names.add(name)

        # ---- length
        given = [k for k in _LENGTH_KEYS if _get(ph, k) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"{where} sets {', '.join(given) if given else 'no length'}; set exactly one of "
                f"{key}.tokens (length in tokens), {key}.steps (length in steps of "
                f"schedule.global_batch_tokens={_fmt(B)}) or {key}.until_tokens (end, tokens from the start)"
            )
        kind = given[0]
        value = _get(ph, kind)
        if not _is_int(value):
            raise ConfigError(f"{key}.{kind}={value!r} must be an integer")
        if value < 0:
            raise ConfigError(f"{key}.{kind}={value} is negative; allowed: an integer >= 0 (0 skips the phase)")
        start = end
        if kind == "tokens":
            end = start + value
        elif kind == "steps":
            end = start + value * B
        else:
            if value < start:
                if prev is not None and prev["kind"] == "steps":
                    raise ConfigError(
                        f"{key}.until_tokens={_fmt(value)} ends before the warmup phase "
                        f"'{prev['name']}' ({prev['value']} steps x {_fmt(B)} tokens) is over at "
                        f"{_fmt(start)} tokens: the warmup is longer than the phase it opens; allowed: "
                        f"{key}.until_tokens >= {_fmt(start)}, or fewer warmup steps"
                    )
                raise ConfigError(
                    f"{key}.until_tokens={_fmt(value)} is before the end of the previous phase "
                    f"'{prev['name']}' at {_fmt(start)} tokens: phases out of order; allowed: "
                    f"{key}.until_tokens >= {_fmt(start)}"
                )
            end = value

        # ---- learning rate
        style = _get(ph, "lr_style")
        if style not in LR_STYLES:
            raise ConfigError(
                f"{key}.lr_style={style!r} is not a known decay style; allowed: {', '.join(LR_STYLES)}"
            )
        lr_start, lr_end = _get(ph, "lr_start"), _get(ph, "lr_end")
        if style == "continue":
            if prev is None:
                raise ConfigError(f"{key}.lr_style=continue on the first phase: there is no rule to "
                                  f"continue; allowed: {', '.join(LR_STYLES[:-1])}")
            if lr_start is not None or lr_end is not None:
                raise ConfigError(
                    f"{where} has lr_style=continue and sets lr_start/lr_end; a continued phase takes "
                    f"its LR from the rule of '{prev['name']}': set {key}.lr_start and {key}.lr_end to null"
                )
        else:
            if lr_start is None:
                if prev is None:
                    raise ConfigError(f"{key}.lr_start is not set; the first phase needs a start LR")
                lr_start = prev["seg_lr_end"]
            if lr_end is None:
                if style != "constant":
                    raise ConfigError(f"{key}.lr_end is not set; lr_style={style} needs an end LR")
                lr_end = lr_start
            for k, v in (("lr_start", lr_start), ("lr_end", lr_end)):
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                    raise ConfigError(f"{key}.{k}={v!r} must be a finite number >= 0")
            if style == "constant" and lr_end != lr_start:
                raise ConfigError(
                    f"{key} is constant but lr_end={lr_end} != lr_start={lr_start}; set {key}.lr_end to "
                    f"null or to lr_start, or pick a decay style ({', '.join(LR_STYLES[1:-1])})"
                )

        # ---- context, positions, batch
        seq = _get(ph, "seq_length")
        if seq is None:
            if prev is None:
                raise ConfigError(f"{key}.seq_length is not set; the first phase needs a context length")
            seq = prev["seq_length"]
        if not _is_int(seq) or seq < 1:
            raise ConfigError(f"{key}.seq_length={seq!r} must be an integer >= 1 (tokens)")
        rope = _get(ph, "rope_type")
        if rope is None:
            rope = prev["rope_type"] if prev is not None else _get(model_cfg, "rope_type")
        if rope not in ROPE_TYPES:
            raise ConfigError(f"{key}.rope_type={rope!r}; allowed: {', '.join(ROPE_TYPES)}")
        longest, why = _supported_length(model_cfg, rope)
        if seq > longest:
            raise ConfigError(
                f"{key}.seq_length={_fmt(seq)} with rope_type={rope} is longer than the model's position "
                f"settings support ({why}, model={_get(model_cfg, 'name')}); allowed: seq_length <= "
                f"{_fmt(longest)}"
            )
        if B % seq:
            divs = [d for d in (2**k for k in range(0, 40)) if d <= longest and B % d == 0]
            raise ConfigError(
                f"schedule.global_batch_tokens={_fmt(B)} is not divisible by {key}.seq_length={_fmt(seq)}: "
                f"the global batch must be a whole number of sequences; allowed seq_length: divisors of "
                f"{_fmt(B)} (e.g. {', '.join(_fmt(d) for d in divs[-4:]) or '1'}), or change "
                f"schedule.global_batch_tokens to a multiple of {_fmt(seq)}"
            )
        mbs = _get(ph, "micro_batch_size")
        if mbs is None:
            mbs = prev["micro_batch_size"] if prev is not None else default_mbs
        if not _is_int(mbs) or mbs < 1:
            raise ConfigError(f"{key}.micro_batch_size={mbs!r} must be an integer >= 1 (sequences)")

        rec = dict(index=i, name=name, kind=kind, value=value, start=start, end=end, style=style,
                   lr_start=lr_start, lr_end=lr_end, seq_length=seq, rope_type=rope,
                   micro_batch_size=mbs, global_batch_size=B // seq)
        # LR of the segment this phase belongs to (for null lr_start of the next phase)
        rec["seg_lr_end"] = prev["seg_lr_end"] if style == "continue" else lr_end
        phases.append(rec)
        prev = rec

    if end <= 0:
        raise ConfigError("the schedule has no tokens: every phase in schedule.phases has length 0")

    # ---- LR segments: a phase + the "continue" phases after it
    segs: list[dict] = []
    for rec in phases:
        if rec["style"] == "continue":
            segs[-1]["end"] = rec["end"]
        else:
            segs.append(dict(start=rec["start"], end=rec["end"], style=rec["style"],
                             lr_start=rec["lr_start"], lr_end=rec["lr_end"]))
        rec["segment"] = len(segs) - 1
    segments = tuple(_Segment(**d) for d in segs)

    from parallel.dims import check_microbatches

    out = []
    for rec in phases:
        seg = segments[rec["segment"]]
        lr_start, lr_end = seg.lr(rec["start"]), seg.lr(rec["end"])
        if rec["style"] != "continue" and seg.end == rec["end"]:
            lr_end = seg.lr_end  # exact value as written
        if rec["style"] != "continue":
            lr_start = seg.lr_start
        first = _ceil_div(rec["start"], B) + 1
        last = _ceil_div(rec["end"], B)
        runs = last >= first
        nmb = None
        if dims is not None and runs:
            key = f"schedule.phases.{rec['index']}"
            mbs_name = (f"{key}.micro_batch_size" if _get(raw[rec["index"]], "micro_batch_size") is not None
                        else "train.micro_batch_size")
            try:
                nmb = check_microbatches(dims, rec["global_batch_size"], rec["micro_batch_size"],
                                         gbs_name="global batch", mbs_name=mbs_name)
            except ConfigError as e:
                raise ConfigError(
                    f"{key} ('{rec['name']}'): schedule.global_batch_tokens={_fmt(B)} / seq_length="
                    f"{_fmt(rec['seq_length'])} = {rec['global_batch_size']:,} sequences per step, which "
                    f"this layout cannot run: {e}; in tokens: make schedule.global_batch_tokens a multiple "
                    f"of {_fmt(_microbatch_unit(dims, rec['micro_batch_size']) * rec['seq_length'])}"
                    + (f", or lower {mbs_name}" if rec["micro_batch_size"] > 1 else "")
                ) from None
        out.append(Phase(
            index=rec["index"], name=rec["name"], start_tokens=rec["start"], end_tokens=rec["end"],
            lr_style=rec["style"], lr_start=float(lr_start), lr_end=float(lr_end),
            seq_length=rec["seq_length"], rope_type=rec["rope_type"],
            micro_batch_size=rec["micro_batch_size"], global_batch_size=rec["global_batch_size"],
            first_step=first if runs else None, last_step=last if runs else None, num_microbatches=nmb,
        ))
    return Schedule(name=str(_get(s, "name", "")), global_batch_tokens=B, weight_decay=float(wd),
                    phases=tuple(out), _segments=segments)


def _microbatch_unit(dims: Any, mbs: int) -> int:
    """Smallest global batch (sequences) megatron's schedule accepts for ``mbs`` under ``dims``."""
    unit = mbs * dims.dp
    return unit * dims.pp if dims.vpp > 1 else unit


def lr_at_tokens(schedule: Schedule, tokens: Sequence[Any]) -> list[float]:
    """``schedule.lr_at`` at each of ``tokens`` in order (``plan.query_tokens``).

    Raises:
        ConfigError: a value that is not a number >= 0, naming ``plan.query_tokens``.
    """
    out = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"plan.query_tokens[{i}]={t!r} must be a token count >= 0")
        out.append(schedule.lr_at(t))
    return out
