"""Two streams, a compute and a communication one, running the schedule nodes of one step of megatron's
combined 1F1B (:mod:`k2.launcher.planning.ep_overlap` builds the nodes and says which steps run them):
:func:`run_nodes` starts each node when its input is ready and its stream is free and reports the step's
time, the compute stream's waits (the exposed all-to-all, by kind) and what communication beside the
compute costs it.

The stream semantics are the profile's ``comm_stream``: ``device`` (CUDA: a second stream; an all-to-all
kernel on it occupies ``comm_share`` of the SMs, so the compute beside it runs at the rest), ``host_thread``
(``k2.parallel.comm_stream``, k2-train on CPU: a thread of the process that also computes, so a
communication node starts no earlier than the host issues it, the thread's own compute takes the CPU from
the compute nodes, and an all-to-all's host work takes ``comm_share`` of it while on the wire).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from k2.launcher.planning.hardware import DEVICE, HOST_THREAD

__all__ = ["A2A_KINDS", "Node", "StepCost", "run_nodes"]

#: the all-to-alls of a MoE layer, by direction; ``other``: those of stage extras (the MTP what-if)
A2A_KINDS = ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd", "other")


def _add(d: dict, key: str, v: float) -> None:
    d[key] = d.get(key, 0.0) + v


@dataclass(frozen=True)
class Node:
    """One schedule node of one microbatch, as :func:`run_nodes` runs it.

    Attributes:
        name: the node (``attn``, ``mlp``, ``dispatch``, ``combine``, ``mlp_dw``, ``attn_dw``, ``pre``,
            ``post``) and, for an all-to-all, its kind (:data:`A2A_KINDS`) in ``kind``.
        micro: ``f`` (the forward microbatch) or ``b`` (the backward one).
        comm: runs on the communication stream.
        wire: seconds of its all-to-all (communication nodes).
        terms: seconds of its compute per term (a communication node's: the compute on that stream).
        event: waits for and records its microbatch's event (False: a delayed weight gradient).
        kind: the all-to-all's kind.
    """

    name: str
    micro: str
    comm: bool = False
    wire: float = 0.0
    terms: dict = field(default_factory=dict)
    event: bool = True
    kind: str = ""

    @functools.cached_property
    def compute(self) -> float:  # (read once per node per pass of run_nodes: summed once)
        return sum(self.terms.values())


@dataclass
class StepCost:
    """One step of the combined schedule (a pair, or one microbatch's forward or backward) on one rank.

    Attributes:
        seconds: its time.
        terms: its seconds by term, exposed communication and offload included; they sum to ``seconds``.
        exposed: exposed all-to-all seconds per kind (:data:`A2A_KINDS`); their sum is ``terms['ep_comm']``.
        wire: all-to-all seconds per kind, exposed or hidden.
        compute: the compute stream's own work by term (``terms`` less what its waits and the
            communication thread's compute add).
    """

    seconds: float
    terms: dict
    exposed: dict
    wire: dict
    compute: dict = field(default_factory=dict)


def _overlap(intervals, a: float, b: float) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e, _ in intervals)


def _stretch(start: float, work: float, stolen: list) -> float:
    """When a compute node of ``work`` seconds started at ``start`` ends, with the share of the processor
    that communication takes meanwhile: ``stolen`` holds ``(a, b, share)`` intervals in which ``share`` of
    it goes elsewhere (1: the host thread's own compute, which runs first; an all-to-all on the wire: its
    ``comm_share``, :func:`run_nodes`); overlapping shares add up, to at most all of it."""
    live = [x for x in stolen if x[1] > start]
    end = start + work
    if all(a > start and a >= end for a, _, _ in live):  # (none starts before the work is done: full speed)
        return end
    t, remaining = start, work
    for nxt in sorted({x for a, b, _ in live for x in (a, b) if x > start}) + [math.inf]:
        speed = 1.0 - min(1.0, sum(share for a, b, share in live if a <= t < b))
        if speed > 0 and t + remaining / speed <= nxt:
            return t + remaining / speed
        remaining -= (nxt - t) * speed
        t = nxt
    return t + remaining


def _compute_end(n: Node, start: float, host: bool, segments: list, on_wire: list, terms: dict) -> float:
    """When compute node ``n`` started at ``start`` ends (:func:`run_nodes`), with the seconds the
    processor's other work adds in ``terms``: on the host's thread ``non_gemm`` (the communication thread's
    compute) and ``ep_comm_host`` (the all-to-alls' own host work), on a GPU ``ep_comm_sms`` (the SMs an
    all-to-all kernel occupies)."""
    stolen = (segments if host else []) + on_wire
    if not stolen:
        return start + n.compute
    stop = _stretch(start, n.compute, stolen)
    extra = stop - start - n.compute
    if extra > 0:
        by_thread = _stretch(start, n.compute, segments) - start - n.compute if host and segments else 0.0
        if by_thread > 0:
            _add(terms, "non_gemm", by_thread)
        if extra > by_thread:
            _add(terms, "ep_comm_host" if host else "ep_comm_sms", extra - by_thread)
    return stop


#: passes of :func:`run_nodes` at most before its all-to-alls' times settle (each pass prices a compute node
#: beside the all-to-alls the previous pass placed; a pass moves only what the one before changed)
_MAX_PASSES = 20


def run_nodes(
    nodes: list[Node],
    comm_stream: str = DEVICE,
    offload_s: float = 0.0,
    comm_share: float = 0.0,
    counts_queue_s: float = 0.0,
    wire_slowdown: float = 1.0,
) -> StepCost:
    """Run ``nodes`` (in issue order) on a compute and a communication stream (module docstring).

    Args:
        nodes: the nodes of one step in issue order
            (:func:`k2.launcher.planning.ep_overlap.step_nodes`).
        comm_stream: ``device`` or ``host_thread``.
        offload_s: seconds of the step's activation copies to and from the host (exposed beyond the step).
        comm_share: the share of the processor an all-to-all takes while it is on the wire, so that a
            compute node beside it is longer by as much: on a GPU the SMs its kernel occupies over
            ``compute_units`` (the profile's ``alltoall_comm_units`` or ``deepep_comm_units``; term
            ``ep_comm_sms``), with ``host_thread`` the share of the CPU its host work takes (the profile's
            ``alltoall_host_cpu_share``; term ``ep_comm_host``).
        counts_queue_s: seconds a node's token-count all-gather (term ``ep_token_counts``, at the node's
            end) waits longer when an all-to-all is on the wire then
            (:meth:`k2.launcher.planning.stage_model.StageModel.token_counts_queue_s`).
        wire_slowdown: with ``host_thread``, how much longer an all-to-all takes on the wire while the host
            computes beside it (the profile's ``alltoall_beside_compute_slowdown``: gloo's threads and the
            kernel's TCP get less of the CPU); its stretched time is the communication stream's, exposed
            where the compute stream waits for it.

    A node is priced beside what runs at the same time, which a later-issued node may be (on a GPU an
    all-to-all issued after a compute node starts as soon as its input is ready; on the host's thread an
    all-to-all runs beside the compute issued after it): each pass prices the nodes beside the previous
    pass's all-to-alls and compute until their times no longer move.

    Returns:
        :class:`StepCost`.
    """
    host = comm_stream == HOST_THREAD
    slow = max(1.0, float(wire_slowdown)) if host else 1.0
    placed: dict = {"on_wire": {}, "busy": {}}
    for _ in range(_MAX_PASSES if (comm_share and not host) or slow > 1 else 1):
        run = _one_pass(nodes, host, comm_share, counts_queue_s, placed, slow)
        if run["on_wire"] == placed["on_wire"] and run["busy"] == placed["busy"]:
            break
        placed = {"on_wire": run["on_wire"], "busy": run["busy"]}
    return _step_cost(nodes, run, offload_s)


def _one_pass(
    nodes: list[Node], host: bool, comm_share: float, counts_queue_s: float, placed: dict, slowdown: float = 1.0
) -> dict:
    """One pass of :func:`run_nodes` over ``nodes``; ``placed``: where the previous pass put each all-to-all
    (``on_wire``: node index -> ``(start, end, comm_share)``) and each compute node (``busy``: node index ->
    ``(start, end, share of the wire's speed lost beside it)``), for the nodes issued before them."""
    comp_free = comm_free = 0.0
    last: dict[str, int] = {}
    end: list[float] = []
    terms: dict[str, float] = {}
    compute: dict[str, float] = {}
    segments: list = []  # the communication stream's compute: (start, end, 1.0)
    on_wire: dict[int, tuple] = {}  # the all-to-alls on the wire by node index: (start, end, comm_share)
    busy: dict[int, tuple] = {}  # the compute nodes by index: (start, end, the wire's lost speed beside them)
    lost = 1.0 - 1.0 / slowdown
    wires: list = []  # (start, end, kind)
    gaps: list = []  # the compute stream's waits
    for k, n in enumerate(nodes):
        # a node waits for its microbatch's last event; a delayed weight gradient records and waits for
        # none (megatron's backward_dw): the compute stream's order puts it after its backward node
        ready = end[last[n.micro]] if n.event and n.micro in last else 0.0
        if n.comm:
            start = max(comm_free, ready, comp_free if host else 0.0)
            beside = list(busy.values()) + [c for j, c in placed["busy"].items() if j > k]
            wire_end = _stretch(start, n.wire, beside) if lost and n.wire else start + n.wire
            wires.append((start, wire_end, n.kind))
            stop = wire_end + n.compute
            if n.compute:
                segments.append((wire_end, stop, 1.0))
            if comm_share and n.wire:
                on_wire[k] = (start, wire_end, comm_share)
            comm_free = stop
        else:
            start = max(comp_free, ready)
            if start > comp_free:
                gaps.append((comp_free, start))
            beside = list(on_wire.values()) + [w for j, w in placed["on_wire"].items() if j > k]
            stop = _compute_end(n, start, host, segments, beside, terms)
            if lost:
                busy[k] = (start, stop, lost)
            if counts_queue_s and n.terms.get("ep_token_counts") and any(a < stop < b for a, b, _ in wires):
                _add(terms, "ep_token_counts", counts_queue_s)  # (a wait: not the stream's own work)
                stop += counts_queue_s
            for t, v in n.terms.items():  # (_add, inlined: the search's innermost loop)
                terms[t] = terms.get(t, 0.0) + v
                compute[t] = compute.get(t, 0.0) + v
            comp_free = stop
        end.append(stop)
        if n.event:
            last[n.micro] = k
    return {
        "end": end,
        "comp_free": comp_free,
        "terms": terms,
        "compute": compute,
        "segments": segments,
        "on_wire": on_wire,
        "busy": busy,
        "wires": wires,
        "gaps": gaps,
    }


def _step_cost(nodes: list[Node], run: dict, offload_s: float) -> StepCost:
    """The :class:`StepCost` of a pass of :func:`run_nodes`: the compute stream's waits attributed to the
    all-to-alls in flight (``ep_comm``) or to the communication stream's compute (``non_gemm``)."""
    terms, segments, wires, gaps = run["terms"], run["segments"], run["wires"], list(run["gaps"])
    total = max(run["end"], default=0.0)
    if total > run["comp_free"]:
        gaps.append((run["comp_free"], total))
    exposed = {k: 0.0 for k in A2A_KINDS}
    for a, b in gaps:
        on_stream = _overlap(segments, a, b)
        _add(terms, "non_gemm", on_stream)
        rest = b - a - on_stream
        for s, e, kind in wires:
            x = min(rest, max(0.0, min(e, b) - max(s, a)))
            exposed[kind] += x
            rest -= x
        exposed["other"] += max(0.0, rest)
    terms["ep_comm"] = sum(exposed.values())
    terms["offload"] = max(0.0, offload_s - total)
    # (the all-to-alls' time on the wire as run: stretched beside the host's compute, :func:`run_nodes`)
    wire = {k: sum(e - s for s, e, kind in wires if kind == k) for k in A2A_KINDS}
    return StepCost(total + terms["offload"], terms, exposed, wire, run["compute"])
