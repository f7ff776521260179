"""Pipeline schedule hook: deferred weight gradients drained while the input gradient is in flight, and
an event trace of the schedule (config group ``pipeline``).

K2 report, "Training system" (docs/k2_reference.md): in interleaved 1F1B, each microbatch's backward computes
the input gradient first, hands it to the previous stage, and computes the weight gradients while that
send/receive is in flight. The model side (``model/wgrad.py``) queues each linear layer's weight
gradient (W) in a per-rank :class:`k2.model.wgrad.WgradStore` during the backward (B, input gradient only);
this module runs megatron-core's own schedules (``get_forward_backward_func``: interleaved 1F1B with
VPP, 1F1B without, no pipelining on one stage) and hooks them where the send of an input gradient is
*posted*:

* megatron-core 0.19.2 posts every pipeline send/receive in ``p2p_communication._p2p_ops`` (unbatched,
  our VPP setting) or ``_batched_p2p_ops`` (``batch_isend_irecv``, PP without VPP); both return the
  requests without waiting, and the caller (``P2PCommunicator._communicate``) waits on them at once or
  hands them to the schedule, which waits later (``send_prev_wait_handle`` /
  ``recv_next_wait_handles`` in ``forward_backward_pipelining_with_interleaving``). Wrapping these two
  functions is the one place every schedule and phase (warmup, steady 1F1B, cooldown, overlapped or
  not) goes through, so: post the ops -> drain the W queue -> return the requests -> megatron waits.
  megatron-core has no hook there (its ``delay_wgrad_compute`` is TE-only and lives in the combined-1F1B
  EP-overlap schedule), hence the wrappers, which replace the module globals and leave megatron's
  schedule code itself untouched.
* ``k2.schedules.forward_step`` / ``k2.schedules.backward_step`` (module globals the schedules call) are
  wrapped to know which (model chunk, microbatch) runs and to time F and B. A backward whose stage has
  no input gradient to send (the first virtual stage) drains its W right after B.
* ``config.finalize_model_grads_func`` (the DP grad reduce-scatter of the distributed optimizer, the
  embedding and layernorm all-reduces) is wrapped to drain anything left first; at the end of every
  pass the queue must be empty, so the optimizer step sees complete gradients.

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
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

from k2.config import ConfigError
from k2.model.wgrad import WgradStore, check_ddp_hooks, decouple_linear_wgrad

__all__ = ["PipelineHooks", "PipelineTrace", "check_pipeline_config", "read_trace", "draw_trace",
           "setup_pipeline"]

_ACTIVE: Optional["PipelineHooks"] = None  # the hooks of the forward-backward pass running now
_ORIG: dict = {}  # megatron's functions replaced by install_patches()
_TAG = "_k2_tag"  # attribute on activations / input gradients: (chunk, microbatch)


def check_pipeline_config(pipeline_cfg) -> None:
    """``pipeline.trace`` must not name an existing file (it is a directory, created when missing); the
    config-only rules of the section are :func:`k2.config.validate.check_pipeline`'s.

    Args:
        pipeline_cfg: the ``pipeline`` section.

    Raises:
        ConfigError: ``pipeline.trace`` is a file.
    """
    trace = pipeline_cfg.trace
    if trace is not None and Path(trace).exists() and not Path(trace).is_dir():
        raise ConfigError(f"pipeline.trace={trace} is a file; allowed: a directory path (one "
                          "rank<R>.jsonl per rank is written there, created if missing) or null")


# --- tags: which (chunk, microbatch) a tensor belongs to -------------------------------------------------


def _tensors(x) -> list:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [t for t in x if t is not None]
    return [x]


def _set_tag(x, tag) -> None:
    import torch

    for t in _tensors(x):
        if isinstance(t, torch.Tensor):
            setattr(t, _TAG, tag)


def _get_tag(x):
    for t in _tensors(x):
        tag = getattr(t, _TAG, None)
        if tag is not None:
            return tag
    return None


# --- the trace -------------------------------------------------------------------------------------------


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

    def event(self, kind: str, chunk=None, microbatch=None, start=None, end=None, **fields) -> None:
        now = time.time()
        self.events.append({
            "step": self.step, "pass": self.pass_kind, "seq": next(self._seq), "kind": kind,
            "rank": self.rank, "pp_rank": self.pp_rank, "chunk": chunk,
            "stage": None if chunk is None else chunk * self.pp + self.pp_rank,
            "microbatch": microbatch, "start": now if start is None else start,
            "end": now if end is None else end, **fields,
        })

    def flush(self) -> None:
        with self.path.open("a") as f:
            for e in self.events:
                f.write(json.dumps(e) + "\n")
        self.events.clear()


class _TracedWork:
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


# --- the hooks -------------------------------------------------------------------------------------------


class PipelineHooks:
    """Deferred-wgrad draining and the event trace around megatron-core's pipeline schedules.

    Args:
        store: the rank's :class:`k2.model.wgrad.WgradStore` (None: weight gradients are not decoupled).
        trace: a :class:`PipelineTrace` (None: no trace).
    """

    def __init__(self, store=None, trace: Optional[PipelineTrace] = None):
        self.store, self.trace = store, trace
        self.step = 0
        self.last_peak_bytes = 0
        self.last_max_tags_held = 0
        self._req_ids = itertools.count()
        if store is not None and trace is not None:
            store.on_drain = self._on_drain

    # events
    def _event(self, *args, **kwargs) -> None:
        if self.trace is not None:
            self.trace.event(*args, **kwargs)

    def _on_drain(self, tags, n, nbytes, start, end, where) -> None:
        chunk, mb = tags[0] if len(tags) == 1 and tags[0] is not None else (None, None)
        self._event("W", chunk, mb, start, end, n_wgrads=n, bytes=nbytes, where=where,
                    tags=[list(t) if t is not None else None for t in tags])

    def _drain(self, where: str) -> None:
        if self.store is not None and len(self.store):
            self.store.drain(where)

    def step_metrics(self) -> dict:
        """Metrics of the last training pass for ``metrics.jsonl`` (a collective over all ranks when
        weight gradients are decoupled): ``wgrad_deferred_peak_bytes``, the most bytes of deferred
        inputs and output gradients held at once on any rank."""
        if self.store is None:
            return {}
        import torch
        import torch.distributed as dist

        peak = torch.tensor([float(self.last_peak_bytes)],
                            device="cuda" if torch.cuda.is_available() else "cpu")
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {"wgrad_deferred_peak_bytes": int(peak.item())}

    # wrapped megatron functions
    def forward_step(self, orig, *args, **kwargs):
        bound = _ORIG["forward_step_signature"].bind(*args, **kwargs)
        chunk = bound.arguments.get("vp_stage") or 0
        mb = bound.arguments.get("current_microbatch")
        self._drain("late")  # nothing should be left from the previous backward
        start = time.time()
        out = orig(*args, **kwargs)
        _set_tag(out[0], (chunk, mb))
        self._event("F", chunk, mb, start, time.time())
        return out

    def backward_step(self, orig, input_tensor, output_tensor, output_tensor_grad, config):
        tag = _get_tag(output_tensor)
        chunk, mb = tag if tag is not None else (None, None)
        self._drain("late")
        if self.store is not None:
            self.store.tag = tag
        start = time.time()
        try:
            grad = orig(input_tensor, output_tensor, output_tensor_grad, config)
        finally:
            if self.store is not None:
                self.store.tag = None
        self._event("B", chunk, mb, start, time.time())
        _set_tag(grad, tag)
        if not _tensors(grad):  # the first virtual stage: no input gradient to send
            self._drain("no_send")
        return grad

    def p2p_ops(self, orig, batched: bool, **kw):
        reqs = orig(**kw)  # posted, not waited on
        if self.trace is not None:
            reqs = self._trace_p2p(reqs, batched, kw)
        if kw.get("tensor_send_prev") is not None:  # an input gradient is on its way
            self._drain("after_send")
        return reqs

    def _trace_p2p(self, reqs, batched: bool, kw):
        prev, nxt = kw["prev_pipeline_rank"], kw["next_pipeline_rank"]
        ops = [  # megatron's op order in _batched_p2p_ops
            ("send_prev", "send", "grad", kw.get("tensor_send_prev"), prev),
            ("recv_prev", "recv", "act", kw.get("tensor_recv_prev"), prev),
            ("send_next", "send", "act", kw.get("tensor_send_next"), nxt),
            ("recv_next", "recv", "grad", kw.get("tensor_recv_next"), nxt),
        ]
        ops = [o for o in ops if o[3] is not None]
        ids = {}
        for label, kind, what, tensor, peer in ops:  # megatron passes the peers as global ranks
            ids[label] = next(self._req_ids)
            tag = _get_tag(tensor) if kind == "send" else None
            chunk, mb = tag if tag is not None else (None, None)
            self._event(kind, chunk, mb, what=what, peer=peer, req=ids[label], label=label)
        tags = {o[0]: (_get_tag(o[3]) if o[1] == "send" else None) for o in ops}
        if isinstance(reqs, dict):
            return {k: _TracedWork(w, ids.get(k, -1), k, self.trace, tags.get(k)) for k, w in reqs.items()}
        if len(reqs) == len(ops):
            return [_TracedWork(w, ids[o[0]], o[0], self.trace, tags[o[0]]) for w, o in zip(reqs, ops)]
        label = "+".join(o[0] for o in ops)  # one coalesced request (NCCL batch_isend_irecv)
        req = next(self._req_ids)
        return [_TracedWork(w, req, label, self.trace, None) for w in reqs]

    def finalize(self, inner: Callable, *args, **kwargs):
        pending = len(self.store) if self.store is not None else 0
        self._event("finalize", pending=pending)
        self._drain("flush")
        return inner(*args, **kwargs)

    # the pass
    def wrap(self, forward_backward: Callable, tcfg, model: list, first_step: int = 1) -> Callable:
        """``forward_backward`` (megatron's ``get_forward_backward_func()``) with these hooks active
        during each call; ``tcfg.finalize_model_grads_func`` (set it first) drains the queue before
        reducing.

        Args:
            forward_backward: megatron's schedule function.
            tcfg: the run's megatron config (``finalize_model_grads_func`` is wrapped on it).
            model: the DDP-wrapped model chunks (their deferred parameters' DDP hooks are checked).
            first_step: optimizer step of the first training pass (a resumed run starts later).

        Raises:
            RuntimeError: weight gradients are decoupled but DDP was not built with
                ``delay_wgrad_compute=True`` (:func:`k2.model.wgrad.check_ddp_hooks`).
            NotImplementedError: decoupled weight gradients with megatron's ``overlap_grad_reduce``
                (our DDP runs without it: ``k2.parallel.distributed.wrap_model``). The schedule enables
                grad sync only around the ``backward_step`` of a chunk's last microbatch, and that
                microbatch's W runs after it, so DDP's ``register_grad_ready`` would not count it.
        """

        if self.store is not None:
            check_ddp_hooks(model)
            if any(getattr(getattr(m, "ddp_config", None), "overlap_grad_reduce", False) for m in model):
                raise NotImplementedError("pipeline.decouple_wgrad with megatron DDP's overlap_grad_reduce: "
                                          "the last microbatch's deferred wgrads run outside the grad-sync "
                                          "window of megatron's schedule")
        self.step = first_step - 1
        install_patches()
        inner_finalize = tcfg.finalize_model_grads_func
        if inner_finalize is not None and not getattr(inner_finalize, "_k2_pipeline", False):
            def finalize(*args, **kwargs):
                return self.finalize(inner_finalize, *args, **kwargs)

            finalize._k2_pipeline = True
            tcfg.finalize_model_grads_func = finalize

        def run(**kwargs):
            global _ACTIVE
            forward_only = bool(kwargs.get("forward_only", False))
            if not forward_only:
                self.step += 1
            if self.trace is not None:
                self.trace.step, self.trace.pass_kind = self.step, "eval" if forward_only else "train"
            if self.store is not None:
                self.store.reset_peak()
            _ACTIVE = self
            start, cpu0 = time.time(), time.process_time()
            try:
                out = forward_backward(**kwargs)
            finally:
                _ACTIVE = None
            pending = len(self.store) if self.store is not None else 0
            self._drain("flush")
            if self.store is not None:
                self.last_peak_bytes = self.store.peak_bytes
                self.last_max_tags_held = self.store.max_tags_held
            self._event("end", start=start, pending=pending, wgrad_peak_bytes=self.last_peak_bytes,
                        wgrad_max_tags_held=self.last_max_tags_held, cpu_s=time.process_time() - cpu0)
            if self.trace is not None:
                self.trace.flush()
            if pending:
                raise RuntimeError(f"{pending} deferred weight gradients were left after the pass")
            return out

        return run


def install_patches() -> None:
    """Replace megatron-core's ``k2.schedules.forward_step`` / ``backward_step`` and
    ``p2p_communication._p2p_ops`` / ``_batched_p2p_ops`` with wrappers that call the active
    :class:`PipelineHooks` (pass-through when none is active). Idempotent."""
    if _ORIG:
        return
    from inspect import signature

    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules

    _ORIG.update(forward_step=schedules.forward_step, backward_step=schedules.backward_step,
                 p2p_ops=p2p._p2p_ops, batched_p2p_ops=p2p._batched_p2p_ops,
                 forward_step_signature=signature(schedules.forward_step))

    def forward_step(*args, **kwargs):
        h = _ACTIVE
        if h is None:
            return _ORIG["forward_step"](*args, **kwargs)
        return h.forward_step(_ORIG["forward_step"], *args, **kwargs)

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
        h = _ACTIVE
        if h is None:
            return _ORIG["backward_step"](input_tensor, output_tensor, output_tensor_grad, config)
        return h.backward_step(_ORIG["backward_step"], input_tensor, output_tensor, output_tensor_grad,
                               config)

    def p2p_ops(**kw):
        h = _ACTIVE
        return _ORIG["p2p_ops"](**kw) if h is None else h.p2p_ops(_ORIG["p2p_ops"], False, **kw)

    def batched_p2p_ops(**kw):
        h = _ACTIVE
        return (_ORIG["batched_p2p_ops"](**kw) if h is None
                else h.p2p_ops(_ORIG["batched_p2p_ops"], True, **kw))

    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    p2p._p2p_ops, p2p._batched_p2p_ops = p2p_ops, batched_p2p_ops


def uninstall_patches() -> None:
    """Put megatron's functions back (tests)."""
    if not _ORIG:
        return
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules

    schedules.forward_step, schedules.backward_step = _ORIG["forward_step"], _ORIG["backward_step"]
    p2p._p2p_ops, p2p._batched_p2p_ops = _ORIG["p2p_ops"], _ORIG["batched_p2p_ops"]
    _ORIG.clear()


def setup_pipeline(pipeline_cfg, chunks: list):
    """The trainer's entry: decouple the linear layers' weight gradients of ``chunks`` when
    ``pipeline.decouple_wgrad`` (before DDP wraps them) and build the hooks.

    Returns:
        ``(PipelineHooks or None, delay_wgrad_compute)``: None when neither ``pipeline.decouple_wgrad``
        nor ``pipeline.trace`` is set; ``delay_wgrad_compute`` is what megatron's DDP must be built with.
    """
    p = pipeline_cfg
    if not p.decouple_wgrad and p.trace is None:
        return None, False
    import torch.distributed as dist
    from megatron.core import parallel_state as ps


    store = None
    if p.decouple_wgrad:
        store = WgradStore()
        decouple_linear_wgrad(chunks, store)
    trace = None
    if p.trace is not None:
        trace = PipelineTrace(p.trace, dist.get_rank(), ps.get_pipeline_model_parallel_rank(),
                              ps.get_pipeline_model_parallel_world_size())
    return PipelineHooks(store, trace), store is not None


# --- reading and drawing a trace -------------------------------------------------------------------------


def read_trace(directory: str) -> dict[int, list[dict]]:
    """The events of every rank in ``directory``: ``{global rank: [event, ...]}`` in file order."""
    out = {}
    for path in sorted(Path(directory).glob("rank*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if events:
            out[events[0]["rank"]] = events
    return out


def draw_trace(directory: str, path: str, step: Optional[int] = None) -> str:
    """Draw one training step of a trace as a timeline PNG: a row per rank (ordered by PP rank), F / B /
    W boxes labelled with their microbatch (shade = model chunk), waits on communication hatched.

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
    rows = sorted(traces, key=lambda r: (traces[r][0]["pp_rank"], r))
    sel = {r: [e for e in traces[r] if e["step"] == step and e["pass"] == "train"] for r in rows}
    t0 = min(e["start"] for evs in sel.values() for e in evs)
    colors = {"F": ("#9ecae1", "#3182bd"), "B": ("#fdae6b", "#e6550d"), "W": ("#a1d99b", "#31a354")}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.2), dpi=100)
    for y, r in enumerate(rows):
        for e in sel[r]:
            x, w = (e["start"] - t0) * 1e3, max((e["end"] - e["start"]) * 1e3, 1e-3)
            if e["kind"] in colors:
                shade = colors[e["kind"]][(e["chunk"] or 0) % 2]
                ax.barh(y, w, left=x, height=0.8, color=shade, edgecolor="black", linewidth=0.3)
                if e["microbatch"] is not None:
                    ax.text(x + w / 2, y, str(e["microbatch"]), ha="center", va="center", fontsize=6)
            elif e["kind"] == "wait" and w > 0.05:
                ax.barh(y, w, left=x, height=0.3, color="none", edgecolor="grey", hatch="///", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} (pp {traces[r][0]['pp_rank']})" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first event")
    ax.set_title(f"pipeline trace, step {step}: F (blue), B (orange), W (green), light = chunk 0, "
                 "dark = chunk 1; hatched = waiting on p2p")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":  # python -m schedules.pipeline TRACE_DIR OUT.png [STEP]
    import sys

    if len(sys.argv) not in (3, 4):
        print("usage: python -m k2.schedules.pipeline TRACE_DIR OUT.png [STEP]", file=sys.stderr)
        sys.exit(2)
    print(draw_trace(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else None))
