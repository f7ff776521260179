"""The figures ``k2-bench bench=ep_overlap`` reads from one run's ``pipeline.trace`` (its format:
:mod:`k2.schedules.pipeline_trace`): per training step, the forward-backward pass's seconds, the rank's exposed
all-to-all seconds, the all-to-alls' bytes and counts, their wait for the other rank's call and the bytes by
which routing makes one direction of an all-to-all busier than the other."""

from __future__ import annotations

import statistics

__all__ = ["a2a_bytes", "a2a_count", "a2a_excess", "a2a_nodes", "exposed", "pass_seconds", "peer_wait", "step_events"]


def step_events(events: list, step: int) -> list:
    return [e for e in events if e["step"] == step and e["pass"] == "train"]


def exposed(events: list, step: int) -> float:
    """Seconds the rank's main thread spent in all-to-alls in ``step``: the ones it ran itself (no
    overlap; their ``wait`` events have no length) and its waits for communication nodes (overlap)."""
    ev = step_events(events, step)
    own = sum(e["end"] - e["start"] for e in ev if e["kind"] == "a2a" and e.get("thread") == "MainThread")
    waits = sum(e["end"] - e["start"] for e in ev if e["kind"] == "wait" and e.get("what") in ("dispatch", "combine"))
    return own + waits


def pass_seconds(events: list, step: int) -> float:
    end = [e for e in step_events(events, step) if e["kind"] == "end"]
    return end[0]["end"] - end[0]["start"] if end else 0.0


def a2a_bytes(events: list, step: int) -> int:
    return sum(e["bytes"] for e in step_events(events, step) if e["kind"] == "a2a")


def a2a_count(events: list, step: int) -> int:
    return sum(1 for e in step_events(events, step) if e["kind"] == "a2a")


def a2a_key(e: dict) -> tuple:
    return e["microbatch"], e["layer"], e["what"], e["direction"]


def a2a_nodes(events: list, step: int) -> int:
    """The dispatches and combines in ``step`` (a dispatch runs two all-to-alls: the tokens, their
    probabilities)."""
    return len({a2a_key(e) for e in step_events(events, step) if e["kind"] == "a2a"})


def a2a_excess(events: list, step: int) -> float:
    """Bytes per dispatch or combine of ``step`` that the all-to-all's busier direction carries beyond the
    mean of the two (EP2): a MoE layer's forward dispatch sends ``D`` bytes of tokens (``D / 2`` of them to
    the other rank on average) and its combine sends back the ``C`` the rank received, so the two
    directions differ by ``|C - D|`` and the busier one carries ``|C - D| / 2`` more; the backward's
    all-to-alls move the same rows back. Mean over the step's MoE layers and microbatches."""
    dispatch: dict[tuple, float] = {}
    combine: dict[tuple, float] = {}
    for e in step_events(events, step):
        if e["kind"] == "a2a" and e["direction"] == "forward":
            key = (e["microbatch"], e["layer"])
            if e["what"] == "dispatch":
                dispatch.setdefault(key, e["bytes"])  # (its first all-to-all: the tokens; then the probabilities)
            else:
                combine[key] = e["bytes"]
    excess = [abs(combine[k] - d) / 2 for k, d in dispatch.items() if k in combine]
    return statistics.mean(excess) if excess else 0.0


def peer_wait(traces: dict, step: int) -> float:
    """Seconds per rank (the mean of the ranks) that the all-to-alls of ``step`` waited for the other rank to
    call them: an all-to-all moves nothing until every rank of its group has called it, so each one's
    wait is the latest rank's call less this rank's (the k-th all-to-all of a dispatch or combine on one
    rank is the k-th of the same one on the other; ``time.time()``: one clock, the ranks share a machine)."""
    calls: dict = {}
    for rank, events in traces.items():
        for e in step_events(events, step):
            if e["kind"] == "a2a":
                calls.setdefault(a2a_key(e), {}).setdefault(rank, []).append(e["start"])
    waits = {rank: 0.0 for rank in traces}
    for by_rank in calls.values():
        for k, latest in enumerate(map(max, zip(*by_rank.values()))):
            for rank, starts in by_rank.items():
                waits[rank] += latest - starts[k]
    return sum(waits.values()) / max(1, len(waits))
