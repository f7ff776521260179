"""The event loop of :func:`k2.launcher.planning.pipeline_sim.simulate`: each PP rank runs the operations of
megatron's order in turn, each as soon as its inputs are there (the previous stage's forward, the next stage's
backward, plus the PP send time); deferred weight gradients fill the gaps. The rules are ``pipeline_sim``'s
module docstring; this module only runs them.

Why it is written this way: ``plan.search`` simulates every candidate layout, and a plan of K2's schedule runs
up to 65,536 operations per simulation, so the loop is the planner's hottest code. Each rank's order is
resolved once into integer tuples (the kind, the stage, the index of each input in the ``done`` tables), the
finished operations are kept in flat lists indexed by ``stage * microbatches + microbatch``, and the timeline's
:class:`~k2.launcher.planning.pipeline_sim.Op` records are built once per operation; the order of the
operations, their times and every sum are those of the plain rule, operation by operation.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = ["Op", "run_schedule"]

_F, _B, _PAIR = 0, 1, 2  # entry kinds of a resolved order


class Op(NamedTuple):
    """One operation in the timeline (a named tuple: a simulation makes tens of thousands of them).

    Attributes:
        kind: ``"F"`` forward, ``"B"`` backward (input + weight gradient, or input gradient only when
            split), ``"W"`` weight gradient (split only).
        rank: PP rank.
        chunk: model chunk on the rank (``vpp_stage``).
        stage: virtual stage ``chunk * pp + rank``.
        microbatch: 0-based microbatch.
        start, end: times.
        partner: in a pair (``ep_overlap``), the virtual stage of its other half (the forward and the
            backward of a pair are two ops with the same times); -1 otherwise.
    """

    kind: str
    rank: int
    chunk: int
    stage: int
    microbatch: int
    start: float
    end: float
    partner: int = -1


def _resolve(entry: tuple, r: int, pp: int, num_stages: int, m: int) -> tuple:
    """One entry of :func:`k2.launcher.planning.pipeline_sim.rank_order` as integers: ``(_F, chunk, stage,
    mb, index of the previous stage's forward or -1)``, ``(_B, chunk, stage, mb, index of its own forward,
    index of the next stage's backward or -1)``, ``(_PAIR, forward entry, backward entry)``."""
    if entry[0] == "P":
        return (
            _PAIR,
            _resolve(("F", *entry[1]), r, pp, num_stages, m),
            _resolve(("B", *entry[2]), r, pp, num_stages, m),
        )
    kind, chunk, mb = entry
    stage = chunk * pp + r
    if kind == "F":
        return (_F, chunk, stage, mb, (stage - 1) * m + mb if stage else -1)
    return (_B, chunk, stage, mb, stage * m + mb, (stage + 1) * m + mb if stage < num_stages - 1 else -1)


class _Loop:
    """The state of one simulation (``run_schedule``'s arguments): per rank the next entry, when it is free,
    its busy time and its deferred weight gradients; per (stage, microbatch) when its forward and backward
    ended (None: not run yet)."""

    def __init__(self, pp, orders, m, forward, b_cost, w, decouple_wgrad, p2p_time, max_deferred_w, pair_time):
        num_stages = len(forward)
        self.pp, self.forward, self.b_cost, self.w, self.pair_time = pp, forward, b_cost, w, pair_time
        self.orders = [[_resolve(e, r, pp, num_stages, m) for e in order] for r, order in enumerate(orders)]
        self.decouple_wgrad, self.p2p_time, self.max_deferred_w = decouple_wgrad, p2p_time, max_deferred_w
        self.m = m
        self.pos = [0] * pp
        self.free = [0.0] * pp
        self.busy = [0.0] * pp
        self.done_f: list[float | None] = [None] * (num_stages * m)
        self.done_b: list[float | None] = [None] * (num_stages * m)
        self.wqueue: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
        self.ops: list[Op] = []
        self.waiting: dict[int, list[int]] = {}  # an unscheduled input (:meth:`missing`) -> the ranks waiting
        self.woken: list[int] = []  # ranks whose inputs the last entry completed

    def ready(self, e: tuple) -> float | None:
        """When the inputs of the resolved entry ``e`` are there (a pair: both halves'); None if an input is not
        scheduled yet."""
        if e[0] == _F:
            if e[4] < 0:
                return 0.0
            t = self.done_f[e[4]]
            return None if t is None else t + self.p2p_time
        if e[0] == _B:
            own = self.done_f[e[4]]
            if own is None or e[5] < 0:
                return own
            t = self.done_b[e[5]]
            return None if t is None else max(own, t + self.p2p_time)
        tf, tb = self.ready(e[1]), self.ready(e[2])
        return None if tf is None or tb is None else max(tf, tb)

    def missing(self, e: tuple) -> int:
        """An input of the resolved entry ``e`` not scheduled yet, as a key of ``waiting``: the index of a
        forward in ``done_f``, or ``~index`` of a backward in ``done_b``."""
        if e[0] == _PAIR:
            return self.missing(e[1]) if self.ready(e[1]) is None else self.missing(e[2])
        if e[0] == _F or self.done_f[e[4]] is None:
            return e[4]
        return ~e[5]

    def wait(self, r: int) -> None:
        """Rank ``r`` waits for an input of its next entry (:meth:`missing`)."""
        self.waiting.setdefault(self.missing(self.orders[r][self.pos[r]]), []).append(r)

    def wake(self, key: int) -> None:
        """The input ``key`` (:meth:`missing`) is scheduled: the ranks waiting for it go on (to ``woken``) or
        wait for their next missing input."""
        for q in self.waiting.pop(key, ()):
            if self.ready(self.orders[q][self.pos[q]]) is None:
                self.wait(q)
            else:
                self.woken.append(q)

    def run_entry(self, r: int, e: tuple, start: float) -> None:
        """Run rank ``r``'s next entry ``e`` from ``start``."""
        if e[0] == _PAIR:  # one combined step: the forward of one microbatch and the backward of another
            (_, cf, sf, jf, _), (_, cb, sb, jb, own, _) = e[1], e[2]
            end = start + self.pair_time(sf, sb)
            self.ops += [Op("F", r, cf, sf, jf, start, end, sb), Op("B", r, cb, sb, jb, start, end, sf)]
            self.done_f[sf * self.m + jf] = self.done_b[own] = end
            self.free[r] = end
            self.busy[r] += end - start
            if self.waiting:
                self.wake(sf * self.m + jf)
                self.wake(~own)
        elif e[0] == _F:
            end = start + self.forward[e[2]]
            self.ops.append(Op("F", r, e[1], e[2], e[3], start, end))
            self.done_f[e[2] * self.m + e[3]] = self.free[r] = end
            self.busy[r] += self.forward[e[2]]
            if self.waiting:
                self.wake(e[2] * self.m + e[3])
        else:
            end = start + self.b_cost[e[2]]
            self.ops.append(Op("B", r, e[1], e[2], e[3], start, end))
            self.done_b[e[4]] = self.free[r] = end
            self.busy[r] += self.b_cost[e[2]]
            if self.waiting:
                self.wake(~e[4])
            if self.decouple_wgrad:
                self.wqueue[r].append((e[1], e[3]))
        self.pos[r] += 1

    def run_oldest_w(self, r: int, start: float) -> None:
        chunk, mb = self.wqueue[r].pop(0)
        stage = chunk * self.pp + r
        end = start + self.w[stage]
        self.ops.append(Op("W", r, chunk, stage, mb, start, end))
        self.free[r] = end
        self.busy[r] += self.w[stage]

    def step(self, r: int, t: float) -> bool:
        """Rank ``r`` is free at ``t`` and has entries left: run its next one (or a deferred W). False when it
        must wait for an input that is not scheduled yet."""
        e = self.orders[r][self.pos[r]]
        ready = self.ready(e)
        if len(self.wqueue[r]) >= self.max_deferred_w:  # bound the weight gradients held back
            self.run_oldest_w(r, t)
        elif ready is not None and ready <= t:
            self.run_entry(r, e, t)
        elif self.wqueue[r]:  # the next F/B would wait: fill the gap with a deferred weight gradient
            self.run_oldest_w(r, t)
        elif ready is not None:
            self.run_entry(r, e, ready)
        else:
            return False
        return True

    def run_all(self) -> None:
        """Every rank's entries, the rank free first each time (ties: the lower rank). A rank whose next entry
        waits for an input not scheduled yet sleeps until the entry that schedules it has run (``waiting``):
        the rule "a blocked rank goes on once its inputs are scheduled", without re-checking every blocked
        rank after every entry (the heap orders ranks by ``(free time, rank)``, so when they are pushed
        back does not change the order they run in)."""
        heap = [(0.0, r) for r in range(self.pp)]
        orders, pos, free, woken = self.orders, self.pos, self.free, self.woken
        blocked = 0
        while heap or blocked:
            if not heap:
                raise RuntimeError("pipeline simulation deadlocked (megatron's order cannot make progress)")
            t, r = heapq.heappop(heap)
            if pos[r] == len(orders[r]):
                if self.wqueue[r]:  # cooldown: the remaining weight gradients
                    self.run_oldest_w(r, t)
                    heapq.heappush(heap, (free[r], r))
                continue
            if not self.step(r, t):
                self.wait(r)
                blocked += 1
                continue
            heapq.heappush(heap, (free[r], r))
            for q in woken:  # ranks waiting on an input the step scheduled
                heapq.heappush(heap, (free[q], q))
            blocked -= len(woken)
            woken.clear()


def run_schedule(
    pp: int,
    orders: list[list[tuple]],
    num_microbatches: int,
    forward: Sequence[float],
    b_cost: Sequence[float],
    w: Sequence[float],
    *,
    decouple_wgrad: bool,
    p2p_time: float,
    max_deferred_w: int,
    pair_time: Callable[[int, int], float] | None = None,
) -> tuple[list[Op], list[float]]:
    """Run the ranks' ``orders`` (:func:`k2.launcher.planning.pipeline_sim.rank_order`) with per-stage costs
    ``forward``, ``b_cost`` (the backward as run), ``w`` (the weight gradient, run apart when
    ``decouple_wgrad``), ``pair_time(forward stage, backward stage)`` for a pair. Returns the timeline (in the
    order the operations were run) and the busy time per rank."""
    loop = _Loop(pp, orders, num_microbatches, forward, b_cost, w, decouple_wgrad, p2p_time, max_deferred_w, pair_time)
    loop.run_all()
    return loop.ops, loop.busy
