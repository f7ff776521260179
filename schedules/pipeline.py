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

The event trace and its format: ``k2.schedules.pipeline_trace``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from k2.config import ConfigError
from k2.model.wgrad import WgradStore, check_ddp_hooks, decouple_linear_wgrad
from k2.parallel import comm_stream
from k2.schedules.ep_overlap import OverlapHooks, number_dispatchers
from k2.schedules.ep_overlap import activate as overlap_activate
from k2.schedules.ep_overlap import install_patches as install_overlap_patches
from k2.schedules.pipeline_trace import PipelineTrace, TracedWork, draw_trace, get_tag, read_trace, set_tag, tensors

if TYPE_CHECKING:
    from k2.config.schema import PipelineConfig

__all__ = ["PipelineHooks", "PipelineTrace", "check_pipeline_config", "read_trace", "draw_trace", "setup_pipeline"]

_ACTIVE: PipelineHooks | None = None  # the hooks of the forward-backward pass running now
_ORIG: dict = {}  # megatron's functions replaced by install_patches()


def check_pipeline_config(pipeline_cfg: PipelineConfig) -> None:
    """``pipeline.trace`` must not name an existing file (it is a directory, created when missing); the
    config-only rules of the section are :func:`k2.config.validate.check_pipeline`'s.

    Args:
        pipeline_cfg: the ``pipeline`` section.

    Raises:
        ConfigError: ``pipeline.trace`` is a file.
    """
    trace = pipeline_cfg.trace
    if trace is not None and Path(trace).exists() and not Path(trace).is_dir():
        raise ConfigError(
            f"pipeline.trace={trace} is a file; allowed: a directory path (one "
            "rank<R>.jsonl per rank is written there, created if missing) or null"
        )


# --- the hooks -------------------------------------------------------------------------------------------


class PipelineHooks:
    """Deferred-wgrad draining and the event trace around megatron-core's pipeline schedules.

    Args:
        store: the rank's :class:`k2.model.wgrad.WgradStore` (None: weight gradients are not decoupled).
        trace: a :class:`PipelineTrace` (None: no trace).
        ep_overlap: megatron's combined-1F1B schedule runs (``pipeline.ep_overlap``): its calls come
            through :class:`k2.schedules.ep_overlap.OverlapHooks` (:attr:`overlap`).
    """

    def __init__(self, store=None, trace: PipelineTrace | None = None, ep_overlap: bool = False):
        self.store, self.trace = store, trace
        #: (chunk, microbatch) whose forward or backward megatron's plain schedule runs now
        self.current: tuple | None = None
        self.ep_overlap = ep_overlap
        self.overlap = OverlapHooks(self) if ep_overlap else None
        self.tcfg = None  # the run's megatron config (wrap())
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
        self._event(
            "W",
            chunk,
            mb,
            start,
            end,
            n_wgrads=n,
            bytes=nbytes,
            where=where,
            tags=[list(t) if t is not None else None for t in tags],
        )

    def _drain(self, where: str) -> None:
        if self.store is not None and len(self.store):
            self.store.drain(where)

    def overlaps_in(self, options) -> bool:
        """Whether a phase with these memory options (:class:`k2.model.activation_memory.MemoryOptions`)
        runs the EP overlap (:meth:`enter_phase`)."""
        return self.ep_overlap and not options.recomputes("layer")

    def phase_note(self, options) -> str:
        """What a phase's start line says of the EP overlap (empty without ``pipeline.ep_overlap``)."""
        if not self.ep_overlap:
            return ""
        return (
            ", EP all-to-all overlapped"
            if self.overlaps_in(options)
            else ", EP all-to-all not overlapped in this phase (memory.recompute 'layer' re-runs it)"
        )

    def enter_phase(self, options) -> bool:
        """Run the coming steps with or without the EP overlap: on (when ``pipeline.ep_overlap``) unless
        ``options`` (the phase's :class:`k2.model.activation_memory.MemoryOptions`) recompute whole layers,
        which re-runs their all-to-alls in backward, outside megatron's pairs; megatron reads the flag at
        every forward-backward pass. Returns whether the overlap runs."""
        on = self.overlaps_in(options)
        if self.tcfg is not None and self.ep_overlap:
            self.tcfg.overlap_moe_expert_parallel_comm = on
        return on

    def step_metrics(self) -> dict:
        """Metrics of the last training pass for ``metrics.jsonl`` (a collective over all ranks when
        weight gradients are decoupled): ``wgrad_deferred_peak_bytes``, the most bytes of deferred
        inputs and output gradients held at once on any rank."""
        if self.store is None:
            return {}
        import torch
        import torch.distributed as dist

        peak = torch.tensor([float(self.last_peak_bytes)], device="cuda" if torch.cuda.is_available() else "cpu")
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
        self.current = (chunk, mb)
        try:
            out = orig(*args, **kwargs)
        finally:
            self.current = None
        set_tag(out[0], (chunk, mb))
        self._event("F", chunk, mb, start, time.time())
        return out

    def backward_step(self, orig, input_tensor, output_tensor, output_tensor_grad, config):
        tag = get_tag(output_tensor)
        chunk, mb = tag if tag is not None else (None, None)
        self._drain("late")
        if self.store is not None:
            self.store.tag = tag
        start = time.time()
        self.current = tag
        try:
            grad = orig(input_tensor, output_tensor, output_tensor_grad, config)
        finally:
            self.current = None
            if self.store is not None:
                self.store.tag = None
        self._event("B", chunk, mb, start, time.time())
        set_tag(grad, tag)
        if not tensors(grad):  # the first virtual stage: no input gradient to send
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
            tag = get_tag(tensor) if kind == "send" else None
            chunk, mb = tag if tag is not None else (None, None)
            self._event(kind, chunk, mb, what=what, peer=peer, req=ids[label], label=label)
        tags = {o[0]: (get_tag(o[3]) if o[1] == "send" else None) for o in ops}
        if isinstance(reqs, dict):
            return {k: TracedWork(w, ids.get(k, -1), k, self.trace, tags.get(k)) for k, w in reqs.items()}
        if len(reqs) == len(ops):
            return [TracedWork(w, ids[o[0]], o[0], self.trace, tags[o[0]]) for w, o in zip(reqs, ops)]
        label = "+".join(o[0] for o in ops)  # one coalesced request (NCCL batch_isend_irecv)
        req = next(self._req_ids)
        return [TracedWork(w, req, label, self.trace, None) for w in reqs]

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
            self._check_ddp(model)
        self.step = first_step - 1
        self.tcfg = tcfg
        install_patches()
        if self.overlap is not None or self.trace is not None:  # combined-1F1B calls, all-to-all events
            install_overlap_patches()
            number_dispatchers(model)
            if self.overlap is None:
                self.overlap = OverlapHooks(self)  # (the trace of the all-to-alls without the overlap)
            stream = comm_stream.active_stream()
            if stream is not None and self.trace is not None:
                stream.observer = self.overlap
        self._wrap_finalize(tcfg)

        def run(**kwargs):
            return self._run_pass(forward_backward, **kwargs)

        return run

    @staticmethod
    def _check_ddp(model: list) -> None:
        """With weight gradients decoupled: DDP built for them, without ``overlap_grad_reduce`` (see :meth:`wrap`)."""
        check_ddp_hooks(model)
        if any(getattr(getattr(m, "ddp_config", None), "overlap_grad_reduce", False) for m in model):
            raise NotImplementedError(
                "pipeline.decouple_wgrad with megatron DDP's overlap_grad_reduce: "
                "the last microbatch's deferred wgrads run outside the grad-sync "
                "window of megatron's schedule"
            )

    def _wrap_finalize(self, tcfg) -> None:
        """Make ``tcfg.finalize_model_grads_func`` drain the deferred weight gradients first (:meth:`finalize`);
        once: a function already wrapped is kept."""
        inner_finalize = tcfg.finalize_model_grads_func
        if inner_finalize is not None and not getattr(inner_finalize, "_k2_pipeline", False):

            def finalize(*args, **kwargs):
                return self.finalize(inner_finalize, *args, **kwargs)

            finalize._k2_pipeline = True
            tcfg.finalize_model_grads_func = finalize

    def _run_pass(self, forward_backward: Callable, **kwargs):
        """One call of megatron's schedule (``kwargs``: its arguments) with these hooks active: counts the
        training step, drains what is left of the deferred weight gradients, records the pass's end event."""
        global _ACTIVE
        forward_only = bool(kwargs.get("forward_only", False))
        if not forward_only:
            self.step += 1
        if self.trace is not None:
            self.trace.step, self.trace.pass_kind = self.step, "eval" if forward_only else "train"
        if self.store is not None:
            self.store.reset_peak()
        _ACTIVE = self
        overlap_activate(self.overlap if self.overlap is not None or self.trace is not None else None)
        start, cpu0 = time.time(), time.process_time()
        try:
            out = forward_backward(**kwargs)
        finally:
            _ACTIVE = None
            overlap_activate(None)
        pending = len(self.store) if self.store is not None else 0
        self._drain("flush")
        if self.store is not None:
            self.last_peak_bytes = self.store.peak_bytes
            self.last_max_tags_held = self.store.max_tags_held
        self._event(
            "end",
            start=start,
            pending=pending,
            wgrad_peak_bytes=self.last_peak_bytes,
            wgrad_max_tags_held=self.last_max_tags_held,
            cpu_s=time.process_time() - cpu0,
        )
        if self.trace is not None:
            self.trace.flush()
        if pending:
            raise RuntimeError(f"{pending} deferred weight gradients were left after the pass")
        return out


def install_patches() -> None:
    """Replace megatron-core's ``k2.schedules.forward_step`` / ``backward_step`` and
    ``p2p_communication._p2p_ops`` / ``_batched_p2p_ops`` with wrappers that call the active
    :class:`PipelineHooks` (pass-through when none is active). Idempotent."""
    if _ORIG:
        return
    from inspect import signature

    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules

    _ORIG.update(
        forward_step=schedules.forward_step,
        backward_step=schedules.backward_step,
        p2p_ops=p2p._p2p_ops,
        batched_p2p_ops=p2p._batched_p2p_ops,
        forward_step_signature=signature(schedules.forward_step),
    )

    def forward_step(*args, **kwargs):
        h = _ACTIVE
        if h is None:
            return _ORIG["forward_step"](*args, **kwargs)
        return h.forward_step(_ORIG["forward_step"], *args, **kwargs)

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
        h = _ACTIVE
        if h is None:
            return _ORIG["backward_step"](input_tensor, output_tensor, output_tensor_grad, config)
        return h.backward_step(_ORIG["backward_step"], input_tensor, output_tensor, output_tensor_grad, config)

    def p2p_ops(**kw):
        h = _ACTIVE
        return _ORIG["p2p_ops"](**kw) if h is None else h.p2p_ops(_ORIG["p2p_ops"], False, **kw)

    def batched_p2p_ops(**kw):
        h = _ACTIVE
        return _ORIG["batched_p2p_ops"](**kw) if h is None else h.p2p_ops(_ORIG["batched_p2p_ops"], True, **kw)

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


def setup_pipeline(pipeline_cfg: PipelineConfig, chunks: list):
    """The trainer's entry: decouple the linear layers' weight gradients of ``chunks`` when
    ``pipeline.decouple_wgrad`` (before DDP wraps them), start the CPU stand-in of the communication
    stream when ``pipeline.ep_overlap`` runs without CUDA (``k2.parallel.comm_stream``), and build the
    hooks.

    Returns:
        ``(PipelineHooks or None, delay_wgrad_compute)``: None when none of ``pipeline.decouple_wgrad``,
        ``pipeline.trace`` and ``pipeline.ep_overlap`` is set; ``delay_wgrad_compute`` is what megatron's
        DDP must be built with.
    """
    p = pipeline_cfg
    if not p.decouple_wgrad and p.trace is None and not p.ep_overlap:
        return None, False
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    store = None
    if p.decouple_wgrad:
        store = WgradStore()
        decouple_linear_wgrad(chunks, store)
    trace = None
    if p.trace is not None:
        trace = PipelineTrace(
            p.trace, dist.get_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        )
    if p.ep_overlap:
        install_overlap_patches()
        if not torch.cuda.is_available():
            comm_stream.install()
    return PipelineHooks(store, trace, ep_overlap=bool(p.ep_overlap)), store is not None


if __name__ == "__main__":  # (the trace's command, under its older name)
    from k2.schedules.pipeline_trace import main

    raise SystemExit(main())
