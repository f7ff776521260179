"""Resolve and validate ``cfg.schedule`` into a :class:`k2.schedules.wsd.Schedule` (the rules are in the
docstring of :mod:`k2.schedules.wsd`): each phase's length, LR rule, context length, RoPE type and
microbatch size, the LR segments that ``continue`` phases stretch, and, given the parallel layout,
megatron's microbatch rule for every phase that runs a step. Every error names
``schedule.phases.<i>.<key>`` and the allowed values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from k2.config.choices import LrStyle, RopeType, choice_error, values
from k2.config.errors import ConfigError
from k2.parallel.dims import check_microbatches
from k2.schedules.wsd import LR_RULES, PHASE_LENGTH_KEYS, LRSegment, Phase, Schedule, ceil_div

if TYPE_CHECKING:
    from k2.config.schema import K2Config, MemoryConfig, ModelConfig, PhaseConfig


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fmt(n: int) -> str:
    return f"{n:,}"


def _supported_length(model_cfg: ModelConfig, rope_type: str) -> tuple[int, str]:
    """Longest context the model's position settings allow under ``rope_type`` and why."""
    max_pos = int(model_cfg.max_position_embeddings)
    if rope_type == "yarn":
        orig = int(model_cfg.original_max_position_embeddings)
        factor = float(model_cfg.rotary_scaling_factor)
        yarn_max = int(orig * factor)
        if yarn_max < max_pos:
            return yarn_max, (f"model.original_max_position_embeddings={orig} x model.rotary_scaling_factor={factor:g}")
    return max_pos, f"model.max_position_embeddings={max_pos}"


def resolve_schedule(cfg: K2Config, dims: Any = None) -> Schedule:
    """Validate ``cfg.schedule`` against ``cfg.model`` (and the parallel layout) and resolve it.

    Args:
        cfg: the composed config; reads ``schedule``, ``model`` (position settings, ``rope_type``) and
            ``train.micro_batch_size``.
        dims: optional :class:`k2.parallel.dims.ParallelDims`; when given, megatron's microbatch rule
            (:func:`k2.parallel.dims.check_microbatches`) is checked for every phase that runs a step, and
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
            the model's position settings support (plain RoPE: ``k2.model.max_position_embeddings``; YaRN:
            also ``original_max_position_embeddings x rotary_scaling_factor``); an unknown
            ``rope_type``; ``schedule.global_batch_tokens`` not divisible by a phase's ``seq_length``;
            duplicate phase names; a schedule with no tokens; and (with ``dims``) a phase whose global
            batch megatron's pipeline schedule cannot split into microbatches.
    """
    s = cfg.schedule
    B = s.global_batch_tokens
    if not _is_int(B) or B < 1:
        raise ConfigError(f"schedule.global_batch_tokens={B!r} must be an integer >= 1 (tokens per step)")
    wd = s.weight_decay
    if wd is None or float(wd) < 0:
        raise ConfigError(f"schedule.weight_decay={wd!r} must be a number >= 0")
    raw = list(s.phases or [])
    if not raw:
        raise ConfigError("schedule.phases is empty; a schedule needs at least one phase (see recipes/schedule/)")
    recs: list[dict] = []
    for i, ph in enumerate(raw):
        recs.append(_resolve_phase(i, ph, recs[-1] if recs else None, recs, B, cfg.model, cfg.train.micro_batch_size))
    if recs[-1]["end"] <= 0:
        raise ConfigError("the schedule has no tokens: every phase in schedule.phases has length 0")
    segments = _lr_segments(recs)
    memories = _phase_memories(raw, cfg.memory)
    phases = tuple(
        _phase(rec, segments[rec["segment"]], B, _microbatches(rec, raw, dims, B), memories[i])
        for i, rec in enumerate(recs)
    )
    return Schedule(name=str(s.name), global_batch_tokens=B, weight_decay=float(wd), phases=phases, _segments=segments)


def _resolve_phase(
    i: int, ph: PhaseConfig, prev: dict | None, done: list, B: int, model_cfg: ModelConfig, default_mbs: Any
) -> dict:
    """Phase ``i`` of ``schedule.phases`` with every default filled in from ``prev`` (the resolved phase
    before it) and checked; a dict of its settings (``start`` / ``end`` in nominal tokens)."""
    key = f"schedule.phases.{i}"
    name = str(ph.name or f"phase{i}")
    if any(r["name"] == name for r in done):
        raise ConfigError(f"{key}.name={name!r} is used twice; phase names must be unique")
    where = f"{key} ('{name}')"
    start = prev["end"] if prev is not None else 0
    kind, value, end = _phase_length(key, where, ph, start, prev, B)
    style, lr_start, lr_end = _phase_lr(key, where, ph, prev)
    seq, rope, mbs = _phase_context(key, ph, prev, B, model_cfg, default_mbs)
    rec = dict(
        index=i,
        name=name,
        kind=kind,
        value=value,
        start=start,
        end=end,
        style=style,
        lr_start=lr_start,
        lr_end=lr_end,
        seq_length=seq,
        rope_type=rope,
        micro_batch_size=mbs,
        global_batch_size=B // seq,
    )
    # LR of the segment this phase belongs to (for null lr_start of the next phase)
    rec["seg_lr_end"] = prev["seg_lr_end"] if style == "continue" else lr_end
    return rec


def _phase_length(key: str, where: str, ph: PhaseConfig, start: int, prev: dict | None, B: int):
    """``(kind, value, end)``: which of tokens / steps / until_tokens the phase sets, its value, and the
    phase's nominal end in tokens from the start of training."""
    given = [k for k in PHASE_LENGTH_KEYS if getattr(ph, k) is not None]
    if len(given) != 1:
        raise ConfigError(
            f"{where} sets {', '.join(given) if given else 'no length'}; set exactly one of "
            f"{key}.tokens (length in tokens), {key}.steps (length in steps of "
            f"schedule.global_batch_tokens={_fmt(B)}) or {key}.until_tokens (end, tokens from the start)"
        )
    kind = given[0]
    value = getattr(ph, kind)
    if not _is_int(value):
        raise ConfigError(f"{key}.{kind}={value!r} must be an integer")
    if value < 0:
        raise ConfigError(f"{key}.{kind}={value} is negative; allowed: an integer >= 0 (0 skips the phase)")
    if kind == "tokens":
        return kind, value, start + value
    if kind == "steps":
        return kind, value, start + value * B
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
    return kind, value, value


def _phase_lr(key: str, where: str, ph: PhaseConfig, prev: dict | None):
    """``(lr_style, lr_start, lr_end)`` of the phase (None, None for ``continue``)."""
    style = ph.lr_style
    if style not in values(LrStyle):
        raise choice_error(f"{key}.lr_style", style)
    lr_start, lr_end = ph.lr_start, ph.lr_end
    if style == "continue":
        if prev is None:
            raise ConfigError(
                f"{key}.lr_style=continue on the first phase: there is no rule to "
                f"continue; allowed: {', '.join(LR_RULES)}"
            )
        if lr_start is not None or lr_end is not None:
            raise ConfigError(
                f"{where} has lr_style=continue and sets lr_start/lr_end; a continued phase takes "
                f"its LR from the rule of '{prev['name']}': set {key}.lr_start and {key}.lr_end to null"
            )
        return style, lr_start, lr_end
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
            f"null or to lr_start, or pick a decay style ({', '.join(LR_RULES[1:])})"
        )
    return style, lr_start, lr_end


def _phase_context(key: str, ph: PhaseConfig, prev: dict | None, B: int, model_cfg: ModelConfig, default_mbs: Any):
    """``(seq_length, rope_type, micro_batch_size)`` of the phase, checked against the model's position
    settings and the global batch in tokens."""
    seq = ph.seq_length
    if seq is None:
        if prev is None:
            raise ConfigError(f"{key}.seq_length is not set; the first phase needs a context length")
        seq = prev["seq_length"]
    if not _is_int(seq) or seq < 1:
        raise ConfigError(f"{key}.seq_length={seq!r} must be an integer >= 1 (tokens)")
    rope = ph.rope_type
    if rope is None:
        rope = prev["rope_type"] if prev is not None else model_cfg.rope_type
    if rope not in values(RopeType):
        raise choice_error(f"{key}.rope_type", rope)
    longest, why = _supported_length(model_cfg, rope)
    if seq > longest:
        raise ConfigError(
            f"{key}.seq_length={_fmt(seq)} with rope_type={rope} is longer than the model's position "
            f"settings support ({why}, model={model_cfg.name}); allowed: seq_length <= "
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
    mbs = ph.micro_batch_size
    if mbs is None:
        mbs = prev["micro_batch_size"] if prev is not None else default_mbs
    if not _is_int(mbs) or mbs < 1:
        raise ConfigError(f"{key}.micro_batch_size={mbs!r} must be an integer >= 1 (sequences)")
    return seq, rope, mbs


def _lr_segments(recs: list[dict]) -> tuple[LRSegment, ...]:
    """The LR rules: a phase plus the ``continue`` phases after it (sets each record's ``segment``)."""
    segs: list[dict] = []
    for rec in recs:
        if rec["style"] == "continue":
            segs[-1]["end"] = rec["end"]
        else:
            segs.append(
                dict(
                    start=rec["start"],
                    end=rec["end"],
                    style=rec["style"],
                    lr_start=rec["lr_start"],
                    lr_end=rec["lr_end"],
                )
            )
        rec["segment"] = len(segs) - 1
    return tuple(LRSegment(**d) for d in segs)


def _microbatches(rec: dict, raw: list[PhaseConfig], dims: Any, B: int) -> int | None:
    """Microbatches per DP rank of a phase that runs a step, checked against megatron's pipeline
    schedule for ``dims``; None without ``dims`` or for a phase that runs no step."""
    first, last = ceil_div(rec["start"], B) + 1, ceil_div(rec["end"], B)
    if dims is None or last < first:
        return None
    key = f"schedule.phases.{rec['index']}"
    mbs_name = f"{key}.micro_batch_size" if raw[rec["index"]].micro_batch_size is not None else "train.micro_batch_size"
    try:
        return check_microbatches(
            dims, rec["global_batch_size"], rec["micro_batch_size"], gbs_name="global batch", mbs_name=mbs_name
        )
    except ConfigError as e:
        raise ConfigError(
            f"{key} ('{rec['name']}'): schedule.global_batch_tokens={_fmt(B)} / seq_length="
            f"{_fmt(rec['seq_length'])} = {rec['global_batch_size']:,} sequences per step, which "
            f"this layout cannot run: {e}; in tokens: make schedule.global_batch_tokens a multiple "
            f"of {_fmt(_microbatch_unit(dims, rec['micro_batch_size']) * rec['seq_length'])}"
            + (f", or lower {mbs_name}" if rec["micro_batch_size"] > 1 else "")
        ) from None


_MEMORY_KEYS = ("fp8_store", "recompute", "offload")


def _phase_memories(raw: list[PhaseConfig], base: MemoryConfig | None) -> list[dict]:
    """Each phase's ``memory.*`` site lists: ``base`` (the memory group; None = all off) with the
    ``schedule.phases.<i>.memory`` overrides of that phase and the ones before it (a key left out or null =
    the previous phase's).

    Raises:
        ConfigError: an unknown key or site in an override (:func:`k2.config.validate.check_phase_memory`).
    """
    from k2.config.validate import check_phase_memory

    current = {k: list((getattr(base, k) if base is not None else None) or []) for k in _MEMORY_KEYS}
    out = []
    for i, ph in enumerate(raw):
        over = ph.memory
        check_phase_memory(over, f"schedule.phases.{i}.memory")
        if over is not None:
            current = {k: (list(over[k]) if k in over and over[k] is not None else v) for k, v in current.items()}
        out.append({k: list(v) for k, v in current.items()})
    return out


def _phase(rec: dict, seg: LRSegment, B: int, num_microbatches: int | None, memory: dict) -> Phase:
    """The resolved :class:`Phase`: its LR at both ends (as written, unless inside a continued rule) and
    its first and last step (the rounding rule of :mod:`k2.schedules.wsd`)."""
    lr_start, lr_end = seg.lr(rec["start"]), seg.lr(rec["end"])
    if rec["style"] != "continue" and seg.end == rec["end"]:
        lr_end = seg.lr_end  # exact value as written
    if rec["style"] != "continue":
        lr_start = seg.lr_start
    first, last = ceil_div(rec["start"], B) + 1, ceil_div(rec["end"], B)
    runs = last >= first
    return Phase(
        index=rec["index"],
        name=rec["name"],
        start_tokens=rec["start"],
        end_tokens=rec["end"],
        lr_style=rec["style"],
        lr_start=float(lr_start),
        lr_end=float(lr_end),
        seq_length=rec["seq_length"],
        rope_type=rec["rope_type"],
        micro_batch_size=rec["micro_batch_size"],
        global_batch_size=rec["global_batch_size"],
        first_step=first if runs else None,
        last_step=last if runs else None,
        num_microbatches=num_microbatches,
        memory=memory,
    )


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
