"""Pipeline-schedule simulator: megatron-core's (interleaved) 1F1B order, per-stage costs, bubble, timeline.

Why our own code: megatron-core runs the schedule but does not predict it; nothing in megatron-core,
Megatron-Bridge or torchtitan simulates a schedule from per-stage costs. The *order* of the operations is
megatron's, taken from its own functions (``megatron.core.pipeline_parallel.schedules``
``get_pp_rank_microbatches`` and ``get_schedule_table``, 0.19.2), so the simulated schedule is the one
``k2-train`` runs:

* PP rank ``r`` runs ``warmup_r`` forward passes, then alternates one forward and one backward (1F1B),
  then the remaining backward passes. With ``vpp > 1`` (interleaved 1F1B) ``warmup_r = 2 (pp - r - 1) +
  (vpp - 1) G`` (``G`` = ``microbatch_group_size_per_vp_stage``, megatron's default ``pp``), counted in
  (microbatch, model chunk) units; forward ``k`` runs the chunk/microbatch of ``schedule_table[k]`` and
  backward ``k`` the same microbatch on chunk ``vpp - 1 - chunk``. Without virtual stages ``warmup_r =
  pp - r - 1``.
* Virtual stage ``g = chunk * pp + r`` (megatron's order). ``F(g, j)`` needs ``F(g-1, j)``; ``B(g, j)``
  needs ``B(g+1, j)`` (the last stage's backward follows its own forward). Point-to-point transfers take
  ``p2p_time`` (default 0).
* Decoupled weight gradients (``decouple_wgrad=True``; K2 report "Training system", zero-bubble
  pipelines' B/W split, megatron's ``delay_wgrad_compute``): ``B`` computes only the input gradient (what
  the previous stage waits for); the weight gradient ``W(g, j)`` is queued on the rank and runs whenever
  the rank's next F/B cannot start yet (it would otherwise idle), and at the end. Without the split, ``B``
  costs input + weight gradient.

* megatron's combined 1F1B (``ep_overlap=True``; ``overlap_moe_expert_parallel_comm``, the EP overlap of
  ``pipeline.ep_overlap``): one more warm-up forward per rank (``get_pp_rank_microbatches``; with
  ``vpp > 1`` only, as megatron runs it), then each 1F1B step is one operation, a *pair*, running one
  microbatch's forward and another's backward together (``combined_1f1b.py``): it starts when both inputs
  are there, takes ``pair_time(forward stage, backward stage)`` and delivers the forward's output and the
  backward's input gradient at its end; without pipelining (``pp = 1``) megatron's
  ``combined_1f1b_schedule_for_no_pipelining`` runs F(0), then pairs (F(j + 1), B(j)), then B(last). The
  weight gradients run inside the operations (``backward`` includes them). In a pair the forward's
  activations build up layer by layer while the backward's are freed: the rank holds at most what it
  held before the pair plus ``pair_transient_bytes`` of the forward's stage (its largest layer: a layer's
  forward runs before its partner layer's backward frees), or what it holds after.

Every rank runs its operations one at a time, in its own order, each as soon as its inputs are there
(discrete-event simulation). Results, per rank: busy time and idle time; the makespan; the *bubble
fraction* = total idle / total busy over the ranks (for equal stages: ``(pp - 1) / (vpp * m)``, the bubble
over the ideal time; with unequal stages it also counts the waiting caused by the imbalance); the peak
activation memory held for backward (stage activation bytes from the forward's end until the backward's
end, or the weight gradient's end when split); the timeline of every operation.

Units: the costs are in any time unit (``k2-plan`` passes seconds); memory in bytes.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from k2.launcher.planning.pipeline_events import Op, run_schedule

__all__ = ["Op", "PipelineResult", "rank_order", "simulate"]


@dataclass
class PipelineResult:
    """Output of :func:`simulate` (see the module docstring)."""

    pp: int
    vpp: int
    num_microbatches: int
    decouple_wgrad: bool
    makespan: float
    busy: list[float]  # per rank
    ops: list[Op] = field(repr=False)
    peak_activation_bytes: list[float] = field(default_factory=list)  # per rank
    peak_in_flight: list[int] = field(default_factory=list)  # per rank: most (chunk, microbatch) held
    ep_overlap: bool = False  # megatron's combined 1F1B (pairs; the weight gradients inside)
    # per rank the held-bytes events in order, with and without the pairs' transient bytes (peak_bytes)
    _events: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def peak_bytes(self, per_stage: Sequence[float], pair_transient: Sequence[float] | None = None) -> list[float]:
        """Per rank, the most bytes held at once when each (virtual stage, microbatch) holds
        ``per_stage[stage]`` from the end of its forward to the end of its backward (or of its weight
        gradient when split); frees count before allocations at equal times. During a pair the rank also
        holds ``pair_transient[forward stage]`` (module docstring).

        Each rank's events (an allocation at a forward's end, a free at the end of what releases it) in time
        order are the same for every ``per_stage``, so they are ordered once per result (:func:`_held_events`);
        a call only sums the bytes, in the order a sort of ``(time, sign, rank, bytes)`` gives them."""
        transient = pair_transient is not None
        if transient not in self._events:
            self._events[transient] = _held_events(
                self.ops, self.pp, self.ep_overlap or not self.decouple_wgrad, transient
            )
        extra = pair_transient or ()  # (codes 2 and 3 occur only in the events with the transient bytes)
        values = (per_stage, [-x for x in per_stage], extra, [-x for x in extra])
        peak = []
        for events, ties in self._events[transient]:
            deltas = [values[code][stage] for code, stage in events]
            for a, b in ties:  # (equal times and signs: the smaller bytes first, as the sort puts them)
                deltas[a:b] = sorted(deltas[a:b])
            peak.append(max(accumulate(deltas, initial=0.0)))
        return peak

    @property
    def idle(self) -> list[float]:
        """Idle time per rank: makespan - busy."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        """Total idle time over total busy time, over all PP ranks."""
        return sum(self.idle) / sum(self.busy)

    def as_dict(self, timeline: bool = False) -> dict:
        out = {
            "pp": self.pp,
            "vpp": self.vpp,
            "num_microbatches": self.num_microbatches,
            "decouple_wgrad": self.decouple_wgrad,
            "ep_overlap": self.ep_overlap,
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "busy_per_rank": self.busy,
            "peak_in_flight_per_rank": self.peak_in_flight,
            "peak_activation_bytes_per_rank": self.peak_activation_bytes,
        }
        if timeline:
            out["timeline"] = [
                [o.kind, o.rank, o.chunk, o.microbatch, o.start, o.end] + ([o.partner] if self.ep_overlap else [])
                for o in self.ops
            ]
        return out


def _held_events(
    ops: list[Op], pp: int, frees_at_b: bool, transient: bool
) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """Per rank, :meth:`PipelineResult.peak_bytes`'s events in time order, frees before allocations at equal
    times, as ``(code, stage)`` (code 0: + the stage's bytes, 1: - them, 2 / 3: + / - a pair's transient
    bytes), and the ``[a, b)`` runs of events with equal times and signs (ordered by their bytes per call).
    ``frees_at_b``: a backward frees its microbatch (else its weight gradient does)."""
    per_rank: list[list[tuple]] = [[] for _ in range(pp)]
    for o in ops:
        if o.kind == "F":
            per_rank[o.rank].append((o.end, 1, 0, o.stage))
            if transient and o.partner >= 0:
                per_rank[o.rank] += [(o.start, 1, 2, o.stage), (o.end, -1, 3, o.stage)]
        elif (o.kind == "B" and frees_at_b) or o.kind == "W":
            per_rank[o.rank].append((o.end, -1, 1, o.stage))
    out = []
    for events in per_rank:
        events.sort()  # (by time and sign; the order within a run of equal ones is set per call, below)
        ties, a = [], 0
        for b in range(1, len(events) + 1):
            if b == len(events) or events[b][:2] != events[a][:2]:
                if b - a > 1:
                    ties.append((a, b))
                a = b
        out.append(([(e[2], e[3]) for e in events], ties))
    return out


def _megatron_schedule():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.pipeline_parallel import schedules
    return schedules


def rank_order(
    pp: int, vpp: int, num_microbatches: int, rank: int, group_size: int | None = None, ep_overlap: bool = False
) -> list[tuple]:
    """The forward/backward order megatron-core runs on PP rank ``rank``: ``[(kind, chunk, microbatch)]``;
    with ``ep_overlap`` (megatron's combined 1F1B, module docstring) a steady 1F1B step is one entry
    ``("P", (forward chunk, microbatch), (backward chunk, microbatch))``.

    Args:
        pp, vpp: pipeline and virtual-pipeline sizes.
        num_microbatches: microbatches per step (per DP rank).
        rank: PP rank.
        group_size: ``microbatch_group_size_per_vp_stage`` (None = megatron's default, ``pp``).
        ep_overlap: megatron's ``overlap_moe_expert_parallel_comm`` schedule.

    Raises:
        ValueError: a count megatron's interleaved schedule rejects (``check_microbatches`` in
            ``parallel/dims.py`` gives the configuration-level message); ``ep_overlap`` with ``pp > 1`` and
            no virtual stages (megatron has no combined schedule there).
    """
    s = _megatron_schedule()
    g = pp if group_size is None else group_size
    if vpp > 1:
        if not (pp <= g <= num_microbatches) or 0 < num_microbatches % g < pp:
            raise ValueError(
                f"interleaved 1F1B needs pp <= group <= microbatches and microbatches % group "
                f"in {{0}} or >= pp (pp={pp}, group={g}, microbatches={num_microbatches})"
            )
        table = s.get_schedule_table(num_microbatches, vpp, g)
    elif ep_overlap and pp > 1:
        raise ValueError(f"megatron's combined 1F1B (EP overlap) needs virtual stages when pp > 1 (pp={pp})")
    else:
        table = [(j, 0) for j in range(num_microbatches)]
    comm = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(size=lambda: pp, rank=lambda: rank),
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )
    total, _, warmup, remaining = s.get_pp_rank_microbatches(
        num_microbatches, vpp, g, p2p_communicator=comm, overlap_moe_expert_parallel_comm=ep_overlap
    )
    if ep_overlap and pp == 1:  # combined_1f1b_schedule_for_no_pipelining: F(0), (F(j+1), B(j)), B(last)
        warmup, remaining = 1, total - 1
    fwd = [("F", c, j) for j, c in table]
    bwd = [("B", vpp - 1 - c, j) for j, c in table]
    order: list[tuple] = fwd[:warmup]
    for k in range(remaining):
        if ep_overlap:
            order.append(("P", fwd[warmup + k][1:], bwd[k][1:]))
        else:
            order += [fwd[warmup + k], bwd[k]]
    order += bwd[remaining:]
    assert sum(2 if e[0] == "P" else 1 for e in order) == 2 * total
    return order


def simulate(
    pp: int,
    vpp: int,
    num_microbatches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float] | None = None,
    *,
    decouple_wgrad: bool = False,
    p2p_time: float = 0.0,
    activation_bytes: Sequence[float] | None = None,
    group_size: int | None = None,
    max_deferred_w: int = 1,
    ep_overlap: bool = False,
    pair_time: Callable[[int, int], float] | None = None,
    pair_transient_bytes: Sequence[float] | None = None,
) -> PipelineResult:
    """Simulate one step of megatron's (interleaved) 1F1B schedule.

    Args:
        pp, vpp: pipeline and virtual-pipeline sizes.
        num_microbatches: microbatches per step (per DP rank).
        forward: per virtual stage (``pp * vpp`` values, pipeline order ``chunk * pp + rank``) the time of
            one microbatch's forward.
        backward: per virtual stage the time of one microbatch's input-gradient backward.
        weight: per virtual stage the time of one microbatch's weight gradient (None = 0); without
            ``decouple_wgrad`` it is added to ``backward``.
        decouple_wgrad: decouple the weight gradient (W) from B (module docstring).
        p2p_time: transfer time between consecutive stages.
        activation_bytes: per virtual stage the bytes one microbatch's forward keeps for its backward.
        group_size: megatron's ``microbatch_group_size_per_vp_stage`` (None = pp).
        max_deferred_w: with ``decouple_wgrad``, the most weight gradients a rank holds back before it
            runs the oldest one ahead of its next F/B. 1 (default, K2): each W runs right after its B,
            or earlier in a gap; larger values let W fill later gaps (zero-bubble style) at the cost of
            activations held longer.
        ep_overlap: megatron's combined 1F1B (module docstring): ``forward`` / ``backward`` are the
            costs of a step running one microbatch alone (``backward`` with its weight gradient;
            ``weight`` and ``decouple_wgrad`` are then not used), ``pair_time(forward stage, backward
            stage)`` that of a pair; ``pair_transient_bytes``: per virtual stage what a pair with its
            forward there holds beyond the microbatches (the stage's largest layer).

    Returns:
        :class:`PipelineResult`.

    Raises:
        ValueError: wrong lengths, negative costs, or a microbatch count the schedule rejects.
    """
    S = pp * vpp
    w = list(weight) if weight is not None else [0.0] * S
    act = list(activation_bytes) if activation_bytes is not None else [0.0] * S
    for name, seq in (("forward", forward), ("backward", backward), ("weight", w), ("activation_bytes", act)):
        if len(seq) != S:
            raise ValueError(f"{name} needs pp * vpp = {S} values (one per virtual stage), got {len(seq)}")
        if any(x < 0 for x in seq):
            raise ValueError(f"{name} has a negative value")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
    if ep_overlap and pair_time is None:
        raise ValueError("ep_overlap needs pair_time (the seconds of a forward and a backward together)")
    split = decouple_wgrad and not ep_overlap
    b_cost = list(backward) if split or ep_overlap else [b + x for b, x in zip(backward, w)]
    orders = [rank_order(pp, vpp, num_microbatches, r, group_size, ep_overlap) for r in range(pp)]
    ops, busy = run_schedule(
        pp,
        orders,
        num_microbatches,
        list(forward),
        b_cost,
        w,
        decouple_wgrad=split,
        p2p_time=p2p_time,
        max_deferred_w=max_deferred_w,
        pair_time=pair_time,
    )
    makespan = max(o.end for o in ops)
    result = PipelineResult(pp, vpp, num_microbatches, decouple_wgrad, makespan, busy, ops, ep_overlap=ep_overlap)
    result.peak_activation_bytes = result.peak_bytes(act, pair_transient_bytes)
    result.peak_in_flight = [int(x) for x in result.peak_bytes([1] * S)]
    return result


def plot_timeline(result: PipelineResult, path: str, title: str = "") -> None:
    """Draw the per-rank timeline of ``result`` into ``path`` (PNG): one row per PP rank, forward /
    backward / weight-gradient boxes coloured by kind and shaded by model chunk, idle time blank.

    Raises:
        OSError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    base = {"F": (0.20, 0.45, 0.80), "B": (0.85, 0.40, 0.20), "W": (0.30, 0.65, 0.35)}
    fig, ax = plt.subplots(figsize=(14, 0.35 * result.pp + 1.6))
    for kind in "FBW":
        for chunk in range(result.vpp):
            boxes = [(o.start, o.end - o.start) for o in result.ops if o.kind == kind and o.chunk == chunk]
            if not boxes:
                continue
            dark = 0.4 * chunk / max(1, result.vpp - 1)  # later model chunks darker
            color = tuple(c * (1.0 - dark) for c in base[kind])
            by_rank: dict[tuple, list] = {}
            for o in result.ops:
                if o.kind == kind and o.chunk == chunk:
                    by_rank.setdefault((o.rank, o.partner >= 0), []).append((o.start, o.end - o.start))
            for (r, paired), bars in by_rank.items():
                # a pair (EP overlap): its forward in the upper half of the row, its backward in the lower
                y = (r - 0.4, 0.8) if not paired else ((r - 0.4, 0.4) if kind == "F" else (r, 0.4))
                ax.broken_barh(bars, y, facecolors=color, edgecolor="none")
    ax.set_ylim(result.pp - 0.5, -0.5)
    ax.set_yticks(range(result.pp))
    ax.set_yticklabels([f"pp {r}" for r in range(result.pp)], fontsize=7)
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time (s)")
    kinds = [("F", "forward"), ("B", "backward (input grad)" if result.decouple_wgrad else "backward")]
    if result.decouple_wgrad:
        kinds.append(("W", "weight grad"))
    if result.vpp > 1:
        kinds.append(("", "darker: later model chunk"))
    if result.ep_overlap:
        kinds.append(("", "EP overlap pair: forward above, backward below"))
    ax.legend(
        handles=[Patch(color=base.get(k, (0.3, 0.3, 0.3)), label=lbl) for k, lbl in kinds],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        ncol=len(kinds),
        frameon=False,
    )
    ax.set_title(
        title
        or (
            f"pp {result.pp} x vpp {result.vpp}, {result.num_microbatches} microbatches: "
            f"bubble {100 * result.bubble_fraction:.2f}%"
        ),
        fontsize=9,
        loc="left",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
