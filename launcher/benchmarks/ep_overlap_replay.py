"""One rank's traced training step with ``pipeline.ep_overlap`` on, replayed on its two streams with its
measured durations or with their means: how much of the exposed all-to-all the all-to-alls' wait for the
other rank's call and the variation of the durations make, which a model of one rank with mean durations
(``k2-plan``'s, :mod:`k2.launcher.planning.two_streams`) has no input for.

From the trace (:mod:`k2.schedules.pipeline_trace`) of one rank: the main thread's sequence of compute
stretches (the time between its ``post`` and ``wait`` events of dispatches and combines, its waits left
out), posts and waits; the communication thread's dispatches and combines in the order posted (its FIFO
order), each taking from its start (its post, or the previous one's end) to its end (its last all-to-all's
end, or the end of the main thread's wait for it where that is later: the node's own compute after its
all-to-all), and each one's wait for the other rank's call (per all-to-all: the latest rank's call less
this rank's). The replay runs the main thread's sequence: a post starts a node when the communication
thread is free, a wait blocks until its node ends; the exposed all-to-all is the sum of those blocks.

Variants (:func:`replay_exposure`): ``as_traced`` (the measured durations: reproduces the trace's waits,
less the little the approximation of a node's end misses), ``no_peer_wait`` (each node shorter by its wait
for the other rank's call), ``means`` (every compute stretch at the mean of its class, the stretches
between the same two kinds of event, and every node at the mean of its kind), ``means_no_peer_wait``.
``means`` is what a model of this rank with exact mean durations would expose; ``as_traced`` over it is
what the durations' variation adds (the exposure is a max of sums of the durations, convex in them).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

__all__ = ["REPLAY_VARIANTS", "main", "replay_exposure", "step_streams"]

#: the variants of :func:`replay_exposure` (module docstring)
REPLAY_VARIANTS = ("as_traced", "no_peer_wait", "means", "means_no_peer_wait")


def _node(e: dict) -> tuple:
    return e["microbatch"], e["layer"], e["what"], e["direction"]


def _own(events: list, step: int) -> list:
    return [e for e in events if e["step"] == step and e["pass"] == "train"]


def step_streams(traces: dict, rank: int, step: int) -> tuple[list, list]:
    """``rank``'s ``step`` as two streams (module docstring): the main thread's sequence of ``("compute",
    seconds)``, ``("post", node)``, ``("wait", node)`` and per node, in posting order, ``{"kind": (what,
    direction), "seconds": its time on the communication thread, "peer_wait": its wait for the other
    rank's call}`` (``node``: its index there)."""
    events = _own(traces[rank], step)
    calls: dict = defaultdict(lambda: defaultdict(list))
    for r, evs in traces.items():
        for e in _own(evs, step):
            if e["kind"] == "a2a":
                calls[_node(e)][r].append(e)
    main = sorted(
        (e for e in events if e["kind"] in ("post", "wait") and e.get("what") in ("dispatch", "combine")),
        key=lambda e: (e["start"], e["seq"]),
    )
    waits = {e["req"]: e for e in main if e["kind"] == "wait"}
    index: dict = {}
    nodes: list[dict] = []
    free: float | None = None
    for e in (x for x in main if x["kind"] == "post"):
        mine = calls[_node(e)][rank]
        start = e["start"] if free is None else max(e["start"], free)
        end = max(a["end"] for a in mine)
        w = waits.get(e["req"])
        if w is not None and w["end"] > w["start"]:
            end = max(end, w["end"])
        peer = sum(
            max(a["start"] for a in group) - a_own["start"]
            for a_own, group in zip(mine, zip(*calls[_node(e)].values()))
        )
        index[e["req"]] = len(nodes)
        nodes.append({"kind": (e["what"], e["direction"]), "seconds": end - start, "peer_wait": peer})
        free = end
    whole = next(e for e in events if e["kind"] == "end")
    seq, t = [], whole["start"]
    for e in main:
        seq += [("compute", e["start"] - t), (e["kind"], index[e["req"]])]
        t = e["end"] if e["kind"] == "wait" else e["start"]
    seq.append(("compute", whole["end"] - t))
    return seq, nodes


def _run(seq: list, seconds: list) -> float:
    """The exposed seconds of ``seq`` with node ``i`` taking ``seconds[i]`` on the communication thread."""
    t = free = exposed = 0.0
    ends: dict = {}
    for op, x in seq:
        if op == "compute":
            t += x
        elif op == "post":
            free = max(t, free) + seconds[x]
            ends[x] = free
        elif ends[x] > t:
            exposed += ends[x] - t
            t = ends[x]
    return exposed


def _class_means(values: list, keys: list) -> list:
    by: dict = defaultdict(list)
    for v, k in zip(values, keys):
        by[k].append(v)
    return [statistics.mean(by[k]) for k in keys]


def replay_exposure(traces: dict, rank: int, step: int) -> dict[str, float]:
    """``rank``'s exposed all-to-all seconds in ``step`` under each of :data:`REPLAY_VARIANTS`."""
    seq, nodes = step_streams(traces, rank, step)
    kinds = [n["kind"] for n in nodes]
    full = [n["seconds"] for n in nodes]
    short = [max(0.0, n["seconds"] - n["peer_wait"]) for n in nodes]

    # a compute stretch's class: the events on either side of it (post / wait and the node's kind)
    def side(i):
        return (seq[i][0], kinds[seq[i][1]]) if 0 <= i < len(seq) and seq[i][0] != "compute" else None

    stretches = [(i, x) for i, (op, x) in enumerate(seq) if op == "compute"]
    means = _class_means([x for _, x in stretches], [(side(i - 1), side(i + 1)) for i, _ in stretches])
    mean_seq = list(seq)
    for (i, _), m in zip(stretches, means):
        mean_seq[i] = ("compute", m)
    return {
        "as_traced": _run(seq, full),
        "no_peer_wait": _run(seq, short),
        "means": _run(mean_seq, _class_means(full, kinds)),
        "means_no_peer_wait": _run(mean_seq, _class_means(short, kinds)),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m k2.launcher.benchmarks.ep_overlap_replay TRACE_DIR``: per timed step (the first is not) and
    rank of a ``pipeline.trace`` directory of a run with the overlap on, the exposed all-to-all seconds of
    each variant, one JSON line each."""
    import json
    import sys

    from k2.schedules.pipeline_trace import read_trace

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -m k2.launcher.benchmarks.ep_overlap_replay TRACE_DIR (a pipeline.trace directory "
            "of a run with pipeline.ep_overlap=true)",
            file=sys.stderr,
        )
        return 2
    traces = read_trace(args[0])
    if not traces:
        print(f"{args[0]}: no rank<R>.jsonl trace files", file=sys.stderr)
        return 2
    steps = sorted({e["step"] for e in next(iter(traces.values())) if e["pass"] == "train"})[1:]
    for step in steps:
        for rank in sorted(traces):
            print(json.dumps({"step": step, "rank": rank, **replay_exposure(traces, rank, step)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
