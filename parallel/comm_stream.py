"""CPU stand-in for the communication CUDA stream of megatron-core's combined-1F1B EP-overlap schedule.

megatron-core 0.19.2 hides the MoE all-to-alls of one microbatch under the compute of another
(``overlap_moe_expert_parallel_comm``; ``pipeline_parallel/combined_1f1b.py``,
``models/common/model_chunk_schedule_plan.py``): each transformer layer is split into schedule nodes
(``pipeline_parallel/utils.py`` ``ScheduleNode``), the compute nodes (attention + router, experts) run on
the compute stream and the communication nodes (dispatch, combine) on a second CUDA stream, and a CUDA
event per microbatch orders the nodes of one microbatch across the two streams. The host only *issues*
work: it returns from a communication node at once and issues the other microbatch's compute, which
the GPU runs while the all-to-all is on the wire.

On CPU every call is synchronous, so the same schedule would run the all-to-all and then the compute.
This module gives the CPU what the second stream gives a GPU: a :class:`CommStream` is one daemon
thread that runs the communication nodes in the order they were issued (a CUDA stream's FIFO order);
issuing a node returns a :class:`concurrent.futures.Future` at once, and the first compute node that
consumes it waits for it (what the CUDA event does on a GPU). gloo runs the collective itself on its
own threads; the communication thread also runs the little compute that megatron puts on the
communication stream (the combine's un-permutation and residual add, the autograd of both), as the
GPU's communication stream does. Only megatron's expert-parallel all-to-alls (``pg_collection.ep``,
used by nothing else in training) are issued from the thread, so every process group still sees its
collectives in the same order on every rank.

What is patched (megatron-core 0.19.2, only while :func:`install` is in force, only without CUDA):

* ``pipeline_parallel.utils.get_comm_stream`` / ``set_streams``: the communication stream is the
  :class:`CommStream`;
* ``ScheduleNode.forward`` / ``backward``: a node on the communication stream is submitted to the
  thread and returns a future; every node resolves the futures among its inputs first (on the thread
  that runs it; the thread's FIFO order makes an earlier communication node's future already done);
* ``TransformerModelChunkSchedulePlan.run``: its output (a chunk's last combine) is resolved before the
  schedule attaches the plan to it, and the stream is drained, so nothing of a step is still queued
  when megatron's schedule moves on (the GPU schedule's ``wait_current_stream``);
* ``TransformerLayerSchedulePlan.run`` (one layer of each microbatch of a 1F1B pair): megatron's nodes
  in megatron's stream order, but each communication node *issued* when a GPU's communication stream
  would *start* it (:func:`_layer_pair`). On a GPU the host issues megatron's order
  ``combine_bwd | pre_dispatch_fwd | mlp_bwd | dispatch_fwd | mlp_dw | dispatch_bwd | mlp_fwd |
  combine_fwd | pre_dispatch_bwd`` in microseconds and the streams run it as data arrives: the dispatch
  of the forward microbatch starts as soon as its attention is done, under the other microbatch's
  expert backward, and the backward's dispatch as soon as that expert backward is done, under its
  weight gradients. A CPU thread can only start what the host has issued, and the host computes as it
  issues, so here those two dispatches are issued right after the node they wait for. The
  communication stream's order (``combine_bwd, dispatch_fwd, dispatch_bwd, combine_fwd``), every
  node and every data dependency are megatron's; the results are the same.

An observer (the pipeline trace) sees every communication node: :attr:`CommStream.observer`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["CommStream", "resolve", "install", "uninstall", "active_stream"]

_STATE: dict = {}  # "stream": the installed CommStream; "orig": megatron's functions


class CommStream:
    """A FIFO worker thread standing in for a CUDA stream: :meth:`submit` queues ``fn(*args)`` and
    returns a :class:`~concurrent.futures.Future`; the thread runs queued work in submission order.

    It also answers the ``torch.cuda.Stream`` calls megatron makes on its communication stream
    (``wait_stream``, ``wait_event``, ``record_event``, ``synchronize``, ``query``) and works as the
    ``torch.cuda.stream(...)`` context (a no-op: the thread is where the work runs).

    Attributes:
        observer: None, or an object that sees every communication node (the pipeline trace):
            ``posted(node, direction) -> token`` on the issuing thread when a node is queued
            (``direction``: ``forward`` | ``backward``), ``running(token, fn) -> fn()`` on this stream's
            thread around the node, ``waited(token, start, end)`` when a consumer has waited for it
            (``time.time()`` seconds).
    """

    def __init__(self, name: str = "k2-comm-stream"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.observer = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the consumer, which re-raises it
                fut.set_exception(e)

    def submit(self, fn: Callable, *args) -> Future:
        """Queue ``fn(*args)`` behind everything queued before; returns its future."""
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def synchronize(self) -> None:
        """Block until everything queued so far has run (``torch.cuda.Stream.synchronize``)."""
        self.submit(lambda: None).result()

    def close(self) -> None:
        """Stop the thread after the queued work (the thread is a daemon: a run that exits while a
        collective hangs is not held up by it)."""
        self._queue.put(None)

    # torch.cuda.Stream's interface as megatron uses it on the communication stream
    def wait_stream(self, *a, **k) -> None:
        pass

    def wait_event(self, *a, **k) -> None:
        pass

    def record_event(self, event=None):
        return event

    def query(self) -> bool:
        return self._queue.empty()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def resolve(x: Any, stream: CommStream | None = None) -> Any:
    """``x`` with every :class:`~concurrent.futures.Future` in it (also inside tuples / lists) replaced
    by its result, waiting where needed; the wait is reported to ``stream.observer``."""
    if isinstance(x, Future):
        start = time.time()
        out = x.result()
        obs = stream.observer if stream is not None else None
        token = getattr(x, "_k2_token", None)
        if obs is not None and token is not None:
            x._k2_token = None  # (reported once, by the first consumer)
            obs.waited(token, start, time.time())
        return resolve(out, stream)
    if isinstance(x, tuple):
        return tuple(resolve(e, stream) for e in x)
    if isinstance(x, list):
        return [resolve(e, stream) for e in x]
    return x


def _submit_node(stream: CommStream, node, direction: str, fn: Callable) -> Future:
    """Queue a communication node's ``fn`` on ``stream``, seen by its observer."""
    obs = stream.observer
    if obs is None:
        return stream.submit(fn)
    token = obs.posted(node, direction)
    fut = stream.submit(obs.running, token, fn)
    fut._k2_token = token
    return fut


def _layer_pair(f_layer, b_layer, f_input=None, b_grad=None, is_last_layer_in_bwd=False):
    """megatron's ``TransformerLayerSchedulePlan.run`` (megatron-core 0.19.2: the same nodes and calls)
    with the dispatches issued where a GPU's communication stream starts them (module docstring)."""
    if b_layer is not None:
        b_grad = b_layer.mtp_post_process.backward(b_grad)
        b_grad = b_layer.moe_combine.backward(b_grad)
    if f_layer is not None:
        with f_layer.get_low_precision_context():
            f_input = f_layer.pre_dispatch_computation.forward(f_input)
            f_input = f_layer.moe_dispatch.forward(f_input)  # (megatron: after the backward's mlp)
    if b_layer is not None:
        b_grad = b_layer.mlp.backward(b_grad)
        b_grad = b_layer.moe_dispatch.backward(b_grad)  # (megatron: after mlp_dw)
        b_layer.mlp.backward_dw()
        if b_layer.config.ep_overlap_early_attn_memory_release:
            b_grad = b_layer.pre_dispatch_computation.backward(b_grad)
    if f_layer is not None:
        with f_layer.get_low_precision_context():
            f_input = f_layer.mlp.forward(f_input)
            f_input = f_layer.moe_combine.forward(f_input)
    if b_layer is not None and not b_layer.config.ep_overlap_early_attn_memory_release:
        b_grad = b_layer.pre_dispatch_computation.backward(b_grad)
    if f_layer is not None:
        with f_layer.get_low_precision_context():
            f_input = f_layer.mtp_post_process.forward(f_input)
    if b_layer is not None and not is_last_layer_in_bwd:  # (the chunk's first layer: after the p2p send)
        b_layer.pre_dispatch_computation.backward_dw()
    return f_input, b_grad


def active_stream() -> CommStream | None:
    """The installed :class:`CommStream`, or None."""
    return _STATE.get("stream")


def _node_stream(node):
    """The stream a megatron ``ScheduleNode`` runs on (megatron resolves it lazily the same way)."""
    s = node.stream
    if callable(s) and not isinstance(s, CommStream):
        s = s()
        node.stream = s
    return s


def install() -> CommStream:
    """Make megatron-core's combined-1F1B schedule run its communication nodes on a
    :class:`CommStream` (CPU only; idempotent). Returns the stream.

    Raises:
        RuntimeError: CUDA is available (the real communication stream is used there).
    """
    import torch

    if torch.cuda.is_available():
        raise RuntimeError(
            "comm_stream.install() is the CPU stand-in for megatron's communication CUDA "
            "stream; with CUDA the real stream is used"
        )
    if "stream" in _STATE:
        return _STATE["stream"]
    from megatron.core.models.common import model_chunk_schedule_plan as plan_mod
    from megatron.core.pipeline_parallel import utils as pp_utils

    stream = CommStream()
    orig = {
        "get_comm_stream": pp_utils.get_comm_stream,
        "set_streams": pp_utils.set_streams,
        "forward": pp_utils.ScheduleNode.forward,
        "backward": pp_utils.ScheduleNode.backward,
        "plan_get_comm_stream": plan_mod.get_comm_stream,
        "chunk_run": plan_mod.TransformerModelChunkSchedulePlan.__dict__["run"],
        "layer_run": plan_mod.TransformerLayerSchedulePlan.__dict__["run"],
    }

    def forward(node, inputs=()):
        if _node_stream(node) is stream:
            return _submit_node(stream, node, "forward", lambda: orig["forward"](node, resolve(inputs, stream)))
        return orig["forward"](node, resolve(inputs, stream))

    def backward(node, output_grad):
        if _node_stream(node) is stream:
            return _submit_node(stream, node, "backward", lambda: orig["backward"](node, resolve(output_grad, stream)))
        return orig["backward"](node, resolve(output_grad, stream))

    chunk_run = orig["chunk_run"].__func__

    def run(
        f_schedule_plan,
        b_schedule_plan,
        b_grad=None,
        pre_forward=None,
        pre_backward=None,
        post_forward=None,
        post_backward=None,
    ):
        def resolved(fn):  # the p2p send of a chunk's output / input gradient needs the tensor itself
            return None if fn is None else (lambda x, *a, **k: fn(resolve(x, stream), *a, **k))

        out = chunk_run(
            f_schedule_plan,
            b_schedule_plan,
            b_grad,
            pre_forward,
            pre_backward,
            resolved(post_forward),
            resolved(post_backward),
        )
        out = resolve(out, stream)
        stream.synchronize()
        return out

    pp_utils.get_comm_stream = lambda: stream
    pp_utils.set_streams = lambda comm_stream=None, high_priority=False: None
    plan_mod.get_comm_stream = pp_utils.get_comm_stream
    pp_utils.ScheduleNode.forward = forward
    pp_utils.ScheduleNode.backward = backward
    plan_mod.TransformerModelChunkSchedulePlan.run = staticmethod(run)
    plan_mod.TransformerLayerSchedulePlan.run = staticmethod(_layer_pair)
    _STATE.update(stream=stream, orig=orig)
    return stream


def uninstall() -> None:
    """Put megatron's functions back and stop the thread (tests)."""
    if "stream" not in _STATE:
        return
    from megatron.core.models.common import model_chunk_schedule_plan as plan_mod
    from megatron.core.pipeline_parallel import utils as pp_utils

    orig = _STATE["orig"]
    pp_utils.get_comm_stream = orig["get_comm_stream"]
    pp_utils.set_streams = orig["set_streams"]
    plan_mod.get_comm_stream = orig["plan_get_comm_stream"]
    pp_utils.ScheduleNode.forward = orig["forward"]
    pp_utils.ScheduleNode.backward = orig["backward"]
    plan_mod.TransformerModelChunkSchedulePlan.run = orig["chunk_run"]
    plan_mod.TransformerLayerSchedulePlan.run = orig["layer_run"]
    _STATE.pop("stream").close()
    _STATE.clear()
