"""The event trace of the pipeline schedule (config ``pipeline.trace``): recording, reading, drawing.

The trace (``pipeline.trace=DIR``) is one JSON-lines file per rank, ``DIR/rank<R>.jsonl``, one event per
line in the order they happened on the rank; fields: ``step`` (optimizer step), ``pass`` (``train`` |
``eval``), ``seq`` (order on the rank), ``kind``, ``rank`` (global), ``pp_rank``, ``chunk`` (model
chunk = VPP stage on the rank), ``stage`` (virtual pipeline stage ``chunk * pp + pp_rank``),
``microbatch`` (within the chunk), ``start`` / ``end`` (``time.time()`` seconds). Kinds: ``F``
(forward), ``B`` (backward: input gradient, plus the weight gradient when not decoupled), ``W``
(deferred weight gradients of one (chunk, microbatch): ``n_wgrads``, ``bytes``, ``where`` =
``after_send`` | ``no_send`` | ``late`` | ``flush``), ``send`` / ``recv`` (posted: ``what`` = ``act``
or ``grad``, ``peer`` global rank, ``req`` request id), ``wait`` (``req``, ``label``), ``finalize``
(``pending`` W items when the grad reduction starts), ``end`` (the whole pass from ``start``:
``pending``, ``wgrad_peak_bytes``, ``wgrad_max_tags_held``, ``cpu_s`` = CPU seconds the rank's process
used in the pass, all threads). F/B/W are the planner's F/B/W model (``k2-plan``'s bubble simulator).

Events may come from two threads (the communication stream of ``pipeline.ep_overlap`` on CPU,
``k2.parallel.comm_stream``): ``seq`` and the file order are the order in which they were recorded.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path

__all__ = ["PipelineTrace", "TracedWork", "read_trace", "draw_trace", "get_tag", "set_tag", "tensors"]


_TAG = "_k2_tag"  # attribute on activations / input gradients: (chunk, microbatch)


# --- tags: which (chunk, microbatch) a tensor belongs to -------------------------------------------------


def tensors(x) -> list:
    """The tensors of a schedule's activation / gradient argument (one tensor, a list, or None)."""
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [t for t in x if t is not None]
    return [x]


def set_tag(x, tag) -> None:
    """Mark the tensors of ``x`` as belonging to ``tag`` = (model chunk, microbatch)."""
    import torch

    for t in tensors(x):
        if isinstance(t, torch.Tensor):
            setattr(t, _TAG, tag)


def get_tag(x):
    """The (model chunk, microbatch) of the first tagged tensor of ``x``, or None."""
    for t in tensors(x):
        tag = getattr(t, _TAG, None)
        if tag is not None:
            return tag
    return None


class PipelineTrace:
    """Events of this rank (module docstring for the format), appended to ``DIR/rank<R>.jsonl`` at the
    end of each forward-backward pass."""

    def __init__(self, directory: str, rank: int, pp_rank: int, pp: int):
        self.path = Path(directory) / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.pp_rank, self.pp = rank, pp_rank, pp
        self.events: list[dict] = []
        self._seq = itertools.count()
        self.step = 0
        self.pass_kind = "train"
        self._lock = threading.Lock()

    def event(self, kind: str, chunk=None, microbatch=None, start=None, end=None, **fields) -> None:
        now = time.time()
        with self._lock:
            self._append(kind, chunk, microbatch, now if start is None else start, now if end is None else end, fields)

    def _append(self, kind, chunk, microbatch, start, end, fields) -> None:
        self.events.append(
            {
                "step": self.step,
                "pass": self.pass_kind,
                "seq": next(self._seq),
                "kind": kind,
                "rank": self.rank,
                "pp_rank": self.pp_rank,
                "chunk": chunk,
                "stage": None if chunk is None else chunk * self.pp + self.pp_rank,
                "microbatch": microbatch,
                "start": start,
                "end": end,
                **fields,
            }
        )

    def flush(self) -> None:
        with self._lock:
            events, self.events = self.events, []
        with self.path.open("a") as f:
            for e in events:
                f.write(json.dumps(e) + "\n")


class TracedWork:
    """A pipeline send/receive request whose ``wait()`` is recorded (megatron only calls ``wait``)."""

    def __init__(self, work, req: int, label: str, trace: PipelineTrace, tag):
        self._work, self.req, self.label, self._trace, self._tag = work, req, label, trace, tag

    def wait(self, *args, **kwargs):
        start = time.time()
        out = self._work.wait(*args, **kwargs)
        chunk, mb = self._tag if self._tag is not None else (None, None)
        self._trace.event("wait", chunk, mb, start, time.time(), req=self.req, label=self.label)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def read_trace(directory: str) -> dict[int, list[dict]]:
    """The events of every rank in ``directory``: ``{global rank: [event, ...]}`` in file order."""
    out = {}
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if events:
            out[events[0]["rank"]] = events
    return out


def draw_trace(directory: str, path: str, step: int | None = None) -> str:
    """Draw one training step of a trace as a timeline PNG: a row per rank (ordered by PP rank), F / B /
    W boxes labelled with their microbatch (shade = model chunk), waits on communication hatched; with
    the EP all-to-alls in the trace, a row below each rank for them (dispatch purple, combine red, on the
    communication thread with ``pipeline.ep_overlap``, on the rank's own thread without it).

    Args:
        directory: a ``pipeline.trace`` directory.
        path: PNG to write.
        step: optimizer step to draw (None = the last one in the trace).

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = read_trace(directory)
    if step is None:
        step = max(e["step"] for evs in traces.values() for e in evs if e["pass"] == "train")
    ranks = sorted(traces, key=lambda r: (traces[r][0]["pp_rank"], r))
    sel = {r: [e for e in traces[r] if e["step"] == step and e["pass"] == "train"] for r in ranks}
    a2a = any(e["kind"] == "a2a" for evs in sel.values() for e in evs)
    per_rank = 2 if a2a else 1
    t0 = min(e["start"] for evs in sel.values() for e in evs)
    colors = {
        "F": ("#9ecae1", "#3182bd"),
        "B": ("#fdae6b", "#e6550d"),
        "W": ("#a1d99b", "#31a354"),
        "dispatch": ("#bcbddc", "#756bb1"),
        "combine": ("#fcbba1", "#de2d26"),
    }
    fig, ax = plt.subplots(figsize=(14, 0.6 * per_rank * len(ranks) + 1.4), dpi=100)

    def box(y, e, key, height):
        x, w = (e["start"] - t0) * 1e3, max((e["end"] - e["start"]) * 1e3, 1e-3)
        ax.barh(y, w, left=x, height=height, color=colors[key][(e["chunk"] or 0) % 2], edgecolor="black", linewidth=0.3)
        if e["microbatch"] is not None:
            ax.text(x + w / 2, y, str(e["microbatch"]), ha="center", va="center", fontsize=6)

    labels = []
    for i, r in enumerate(ranks):
        y = i * per_rank
        labels.append(f"rank {r} (pp {traces[r][0]['pp_rank']})")
        if a2a:
            labels.append(f"rank {r} all-to-all")
        for e in sel[r]:
            if e["kind"] in ("F", "B", "W"):
                box(y, e, e["kind"], 0.8)
            elif e["kind"] == "a2a" and e.get("what") in colors:
                box(y + 1, e, e["what"], 0.6 if e.get("thread") == "MainThread" else 0.8)
            elif e["kind"] == "wait" and (e["end"] - e["start"]) * 1e3 > 0.05:
                x, w = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
                ax.barh(y, w, left=x, height=0.3, color="none", edgecolor="grey", hatch="///", linewidth=0.3)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first event")
    ax.set_title(
        f"pipeline trace, step {step}: F (blue), B (orange), W (green), light = chunk 0, dark = chunk 1; "
        f"hatched = waiting{'; all-to-alls: dispatch (purple), combine (red)' if a2a else ' on p2p'}",
        fontsize=9,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list | None = None) -> int:
    """``python -m k2.schedules.pipeline_trace TRACE_DIR OUT.png [STEP]``: draw a step (:func:`draw_trace`),
    print the PNG's path; 2 on a wrong command line."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m k2.schedules.pipeline_trace TRACE_DIR OUT.png [STEP]", file=sys.stderr)
        return 2
    print(draw_trace(args[0], args[1], int(args[2]) if len(args) == 3 else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
