"""K2's communication overlap: the EP all-to-all of one microbatch hidden under the compute of another in
interleaved 1F1B (config ``pipeline.ep_overlap``).

K2 report, "Training system" (docs/k2_reference.md): interleaved 1F1B *adds warm-up micro-batches so that
the EP all-to-all is covered by computation*; EP=16 keeps 64-head attention's compute long enough to cover
it. This is megatron-core 0.19.2's combined-1F1B schedule (``overlap_moe_expert_parallel_comm``), used as
megatron wrote it:

* what is megatron's and reused unchanged: the schedule with the extra warm-up microbatch
  (``pipeline_parallel/schedules.py`` ``get_pp_rank_microbatches``: forward and backward of a 1F1B pair
  are independent), ``combined_1f1b.py`` (one microbatch's forward and another's backward in one step,
  pipeline p2p in its ``pre/post_forward/backward`` callbacks), the model's schedule plan
  (``GPTModel.build_schedule_plan``: a transformer layer split into ``pre_dispatch_computation`` --
  attention, pre-MLP norm, shared expert, router, permutation --, ``moe_dispatch``, ``mlp`` -- the routed
  experts --, ``moe_combine`` -- all-to-all, un-permutation, residual --) and the order in which
  ``TransformerLayerSchedulePlan.run`` interleaves the two microbatches' nodes:
  ``combine_bwd | pre_dispatch_fwd | mlp_bwd | dispatch_fwd | mlp_dw | dispatch_bwd | mlp_fwd |
  combine_fwd | pre_dispatch_bwd | pre_dispatch_dw``, so that each all-to-all is in flight while the
  other microbatch computes;
* what is ours, and why: (1) the layer's saved-tensor scope (FP8 storage, CPU offload, K2's selective
  recompute; ``model/activation_memory.py``) follows the layer across its nodes -- megatron's nodes call
  the layer's parts directly, past the forward hooks that open and commit the scope --, so every tensor is
  stored as in the schedule without overlap; (2) the weight gradients that ``pipeline.decouple_wgrad``
  queues (``model/wgrad.py``) run where megatron runs its delayed wgrads, ``mlp_dw`` and
  ``pre_dispatch_dw`` (megatron's own ``delay_wgrad_compute`` needs Transformer Engine's linear layers);
  (3) the pipeline trace records every node and every all-to-all; (4) on CPU the communication stream is
  a thread (``k2.parallel.comm_stream``), so the overlap is real there too. megatron's
  ``forward_step_func`` protocol (``return_schedule_plan``) is served by
  ``k2.launcher.training.step.forward_step``.

What megatron refuses with this schedule, and why the launcher refuses it first
(``k2.config.validate.check_ep_overlap``): whole-layer recompute (``memory.recompute`` site ``layer``) would re-run the
layer's dispatch and combine all-to-alls in backward, outside the pairs; EP must be > 1 and the
dispatcher ``alltoall``; PP > 1 needs VPP. megatron asserts bf16 for this schedule; its CPU runs here are
fp32, and nothing in the schedule depends on the dtype (on GPUs the launcher keeps megatron's bf16 rule).
"""

from __future__ import annotations

import threading
import time
from inspect import signature

from k2.schedules.pipeline_trace import get_tag, set_tag, tensors

__all__ = ["OverlapHooks", "install_patches", "uninstall_patches", "NODES", "COMM_NODES"]

#: megatron's names of the nodes of a transformer layer, in forward order
NODES = ("pre_dispatch_computation", "moe_dispatch", "mlp", "moe_combine", "mtp_post_process")
#: the nodes on the communication stream, and the all-to-all each carries
COMM_NODES = {"moe_dispatch": "dispatch", "moe_combine": "combine"}

_ACTIVE: OverlapHooks | None = None  # the hooks of the forward-backward pass running now
_ORIG: dict = {}  # megatron's functions replaced by install_patches()
_CTX = threading.local()  # the all-to-all running on this thread: what, direction, tag, layer


def _nbytes(x) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(e) for e in x)
    return 0


class OverlapHooks:
    """The K2 side of megatron's combined-1F1B schedule on one rank: the microbatches of each 1F1B pair,
    the deferred weight gradients at the nodes' ``backward_dw``, and the trace of nodes and all-to-alls.

    Active during a forward-backward pass of :class:`k2.schedules.pipeline.PipelineHooks` (its WgradStore,
    its trace, its request ids); :func:`install_patches` routes megatron's calls here.

    Trace events (``k2.schedules.pipeline_trace`` format) added by this schedule: ``pair`` (one
    combined 1F1B step: ``f`` / ``b`` = the (chunk, microbatch) of its forward and backward, either may be
    null in warm-up and cool-down), ``F`` / ``B`` per compute node (``node`` = megatron's node name,
    ``layer`` = 1-based global layer number), ``post`` / ``wait`` of each dispatch and combine (``what`` =
    ``dispatch`` | ``combine``, ``direction`` = ``forward`` | ``backward``, ``layer``, ``req``: the
    schedule issued it / a consumer waited for it), ``a2a`` (each all-to-all collective as it ran:
    ``what``, ``direction``, ``layer``, ``bytes`` sent by this rank, ``thread``). Without the overlap the
    dispatcher's all-to-alls are recorded too, each ``post`` and ``wait`` around the collective itself.

    Args:
        pipeline: the rank's :class:`k2.schedules.pipeline.PipelineHooks`.
    """

    def __init__(self, pipeline):
        self.pipeline = pipeline
        self.f_tag: tuple | None = None  # (chunk, microbatch) of the running pair's forward
        self.b_tag: tuple | None = None  # ... and backward

    def _event(self, *args, **kw) -> None:
        self.pipeline._event(*args, **kw)

    def _tag(self, direction: str) -> tuple:
        tag = self.f_tag if direction == "forward" else self.b_tag
        return tuple(tag) if tag is not None else (None, None)

    # -- k2.parallel.comm_stream observer (CPU): the communication nodes
    def posted(self, node, direction: str) -> dict:
        chunk, mb = self._tag(direction)
        token = dict(
            chunk=chunk,
            microbatch=mb,
            what=COMM_NODES.get(node.name, node.name),
            direction=direction,
            layer=_layer_of(node),
            req=next(self.pipeline._req_ids),
        )
        self._event("post", chunk, mb, **_fields(token))
        return token

    def running(self, token: dict, fn):
        _CTX.token = token
        try:
            return fn()
        finally:
            _CTX.token = None

    def waited(self, token: dict, start: float, end: float) -> None:
        self._event("wait", token["chunk"], token["microbatch"], start, end, **_fields(token))

    # -- megatron's calls
    def combined_step(self, orig, *args, **kwargs):
        """``combined_1f1b.combined_forward_backward_step``: tags of the pair, W of a first stage."""
        a = _ORIG["combined_signature"].bind(*args, **kwargs).arguments
        f_model, b_model = a.get("f_model"), a.get("b_model")
        self.f_tag = (a.get("f_model_chunk_id") or 0, a.get("current_microbatch")) if f_model is not None else None
        self.b_tag = get_tag(a.get("b_output_tensor")) if b_model is not None else None
        p = self.pipeline
        p._drain("late")
        if p.store is not None:
            p.store.tag = self.b_tag
        start = time.time()
        try:
            out = orig(*args, **kwargs)
        finally:
            if p.store is not None:
                p.store.tag = None
        output_tensor, _num_tokens, input_grad = out
        if f_model is not None:
            set_tag(output_tensor, self.f_tag)
        if b_model is not None:
            set_tag(input_grad, self.b_tag)
            if not tensors(input_grad):  # the first virtual stage: no input gradient to send
                p._drain("no_send")
        self._event(
            "pair",
            None,
            None,
            start,
            time.time(),
            f=list(self.f_tag) if self.f_tag else None,
            b=list(self.b_tag) if self.b_tag else None,
        )
        self.f_tag = self.b_tag = None
        return out

    def compute_node(self, direction: str, node, fn):
        """A compute node's forward or backward: an ``F`` / ``B`` event."""
        start = time.time()
        out = fn()
        chunk, mb = self._tag(direction)
        self._event(
            "F" if direction == "forward" else "B", chunk, mb, start, time.time(), node=node.name, layer=_layer_of(node)
        )
        return out

    def backward_dw(self, node) -> None:
        """megatron's delayed wgrad point of a node: run what ``pipeline.decouple_wgrad`` queued."""
        self.pipeline._drain("mlp_dw" if node.name == "mlp" else "pre_dispatch_dw")

    def a2a(self, token: dict, start: float, end: float, nbytes: int, inline: bool) -> None:
        """One all-to-all collective ran; ``inline``: on the thread of the schedule (no overlap), so it
        is posted and waited for right there."""
        chunk, mb = token["chunk"], token["microbatch"]
        fields = _fields(token)
        if inline:
            self._event("post", chunk, mb, start, start, **fields)
        self._event(
            "a2a",
            chunk,
            mb,
            start,
            end,
            bytes=nbytes,
            thread=threading.current_thread().name,
            **{k: v for k, v in fields.items() if k != "req"},
        )
        if inline:
            self._event("wait", chunk, mb, end, end, **fields)


def _layer_of(node):
    """The 1-based global number of the layer a megatron schedule node belongs to (None: not a layer's)."""
    return getattr(getattr(node, "submodule", None), "_k2_layer", None)


def _fields(token: dict) -> dict:
    return {k: token[k] for k in ("what", "direction", "layer", "req")}


# --- megatron's functions, routed to the active hooks ---------------------------------------------------


def _current_token(what: str | None, direction: str) -> dict:
    """The all-to-all's identity: the communication node running on this thread (overlap), else the
    microbatch the pipeline hooks know is running (``k2.schedules.pipeline.PipelineHooks.current``)."""
    token = getattr(_CTX, "token", None)
    if token is not None:
        return token
    h = _ACTIVE
    chunk, mb = (None, None)
    layer = getattr(_CTX, "layer", None)
    if h is not None and h.pipeline.current is not None:
        chunk, mb = h.pipeline.current
    return dict(
        chunk=chunk,
        microbatch=mb,
        what=what,
        direction=direction,
        layer=layer,
        req=next(h.pipeline._req_ids) if h is not None else None,
    )


def _wrap_layer_callables(layer, funcs: list) -> list:
    """megatron's node functions of one layer (``build_transformer_layer_callables``) with the layer's
    saved-tensor scope across them (``k2.model.activation_memory.run_layer_part``), the layer number on
    each node, the compute nodes traced, and the dispatcher's router probabilities released after the
    last (``k2.model.recompute.K2TransformerLayer._release_dispatch_probs``)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from k2.model.activation_memory import run_layer_part  # (the model's imports: not at k2-train's start)

    # the last node that runs for this layer: the combine of a MoE layer, the MLP of a dense one (its
    # dispatch and combine nodes are megatron's no-ops)
    last = NODES.index("moe_combine" if isinstance(getattr(layer, "mlp", None), MoELayer) else "mlp")
    release = getattr(layer, "_release_dispatch_probs", None)

    def wrap(i, fn):
        name = NODES[i]

        def node_fn(node, *args):
            h = _ACTIVE

            def run():
                if h is not None and name not in COMM_NODES and h.pipeline.trace is not None:
                    return h.compute_node("forward", node, lambda: fn(node, *args))
                return fn(node, *args)

            out = run_layer_part(layer, run, first=(i == 0), last=(i == last))
            if i == last and release is not None:
                release()
            return out

        node_fn._k2_layer = layer.layer_number  # (read by _layer_of: a node is traced before it runs)
        return node_fn

    return [None if f is None else wrap(i, f) for i, f in enumerate(funcs)]


def _combined(*args, **kwargs):
    h = _ACTIVE
    if h is None:
        return _ORIG["combined"](*args, **kwargs)
    return h.combined_step(_ORIG["combined"], *args, **kwargs)


def _build(layer):
    funcs, bwd_dw = _ORIG["build"](layer)
    return _wrap_layer_callables(layer, list(funcs)), bwd_dw


def _backward_impl(node, outputs, output_grad):
    h = _ACTIVE
    run = lambda: _ORIG["backward_impl"](node, outputs, output_grad)  # noqa: E731
    if h is None or h.pipeline.trace is None or node.name in COMM_NODES:
        return run()
    return h.compute_node("backward", node, run)


def _backward_dw(node):
    h = _ACTIVE
    if h is None or h.pipeline.store is None:
        return _ORIG["backward_dw"](node)
    return h.backward_dw(node)


def _named(what, orig):
    """``orig`` (a dispatcher method) with ``what`` ("dispatch"/"combine") and the layer set for the
    all-to-alls it runs."""

    def call(self, *args, **kwargs):
        prev = getattr(_CTX, "what", None), getattr(_CTX, "layer", None)
        _CTX.what, _CTX.layer = what, getattr(self, "_k2_layer_number", None)
        try:
            return orig(self, *args, **kwargs)
        finally:
            _CTX.what, _CTX.layer = prev

    return call


def _traced_a2a_forward(ctx, group, input, output_split_sizes, input_split_sizes, use_nccl_stream=False):
    a2a_forward = _ORIG["a2a_forward"].__func__
    what = getattr(_CTX, "what", None)
    direction = "backward" if getattr(_CTX, "backward", False) else "forward"
    ctx.k2_what, ctx.k2_layer = what, getattr(_CTX, "layer", None)
    h = _ACTIVE
    if h is None or h.pipeline.trace is None:
        return a2a_forward(ctx, group, input, output_split_sizes, input_split_sizes, use_nccl_stream)
    token = _current_token(what, direction)
    start = time.time()
    out = a2a_forward(ctx, group, input, output_split_sizes, input_split_sizes, use_nccl_stream)
    h.a2a(token, start, time.time(), _nbytes(input), inline=getattr(_CTX, "token", None) is None)
    return out


def _traced_a2a_backward(ctx, *grad_output):
    prev = (getattr(_CTX, "what", None), getattr(_CTX, "layer", None), getattr(_CTX, "backward", False))
    _CTX.what, _CTX.layer, _CTX.backward = getattr(ctx, "k2_what", None), getattr(ctx, "k2_layer", None), True
    try:
        return _ORIG["a2a_backward"].__func__(ctx, *grad_output)
    finally:
        _CTX.what, _CTX.layer, _CTX.backward = prev


def _chunk_part(orig):
    """The embedding (pre_process) or the output layer and loss (post_process), traced as compute."""

    def call(node, *args):
        h = _ACTIVE
        if h is None or h.pipeline.trace is None:
            return orig(node, *args)
        return h.compute_node("forward", node, lambda: orig(node, *args))

    return call


def _default_backward(node, outputs, output_grad):
    h = _ACTIVE
    run = lambda: _ORIG["default_backward"](node, outputs, output_grad)  # noqa: E731
    if h is None or h.pipeline.trace is None or node.name not in ("pre_process", "post_process"):
        return run()
    return h.compute_node("backward", node, run)


def install_patches() -> None:
    """Route megatron-core's combined-1F1B calls through the active :class:`OverlapHooks` (pass-through
    when none is active; the layer scopes always): ``combined_1f1b.combined_forward_backward_step``,
    ``fine_grained_callables.build_layer_callables`` (the node functions of each layer),
    ``TransformerLayerNode.backward_impl`` / ``backward_dw``, and the all-to-alls
    (``MoEAlltoAllTokenDispatcher.token_dispatch`` / ``token_combine`` name them, ``_AllToAll`` records
    them). Idempotent."""
    if _ORIG:
        return
    from megatron.core.models.common import fine_grained_callables as fgc
    from megatron.core.models.common.utils import PostProcessNode, PreProcessNode, TransformerLayerNode
    from megatron.core.pipeline_parallel import combined_1f1b
    from megatron.core.pipeline_parallel.utils import ScheduleNode
    from megatron.core.tensor_parallel.mappings import _AllToAll
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    _ORIG.update(
        combined=combined_1f1b.combined_forward_backward_step,
        combined_signature=signature(combined_1f1b.combined_forward_backward_step),
        build=fgc.build_layer_callables,
        backward_impl=TransformerLayerNode.backward_impl,
        backward_dw=TransformerLayerNode.backward_dw,
        a2a_forward=_AllToAll.__dict__["forward"],
        a2a_backward=_AllToAll.__dict__["backward"],
        token_dispatch=MoEAlltoAllTokenDispatcher.token_dispatch,
        token_combine=MoEAlltoAllTokenDispatcher.token_combine,
        pre_process=PreProcessNode.forward_impl,
        post_process=PostProcessNode.forward_impl,
        default_backward=ScheduleNode.default_backward_func,
    )
    combined_1f1b.combined_forward_backward_step = _combined
    fgc.build_layer_callables = _build
    PreProcessNode.forward_impl = _chunk_part(_ORIG["pre_process"])
    PostProcessNode.forward_impl = _chunk_part(_ORIG["post_process"])
    ScheduleNode.default_backward_func = _default_backward
    TransformerLayerNode.backward_impl = _backward_impl
    TransformerLayerNode.backward_dw = _backward_dw
    _AllToAll.forward = staticmethod(_traced_a2a_forward)
    _AllToAll.backward = staticmethod(_traced_a2a_backward)
    MoEAlltoAllTokenDispatcher.token_dispatch = _named("dispatch", _ORIG["token_dispatch"])
    MoEAlltoAllTokenDispatcher.token_combine = _named("combine", _ORIG["token_combine"])


def uninstall_patches() -> None:
    """Put megatron's functions back (tests)."""
    if not _ORIG:
        return
    from megatron.core.models.common import fine_grained_callables as fgc
    from megatron.core.models.common.utils import PostProcessNode, PreProcessNode, TransformerLayerNode
    from megatron.core.pipeline_parallel import combined_1f1b
    from megatron.core.pipeline_parallel.utils import ScheduleNode
    from megatron.core.tensor_parallel.mappings import _AllToAll
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    combined_1f1b.combined_forward_backward_step = _ORIG["combined"]
    fgc.build_layer_callables = _ORIG["build"]
    PreProcessNode.forward_impl = _ORIG["pre_process"]
    PostProcessNode.forward_impl = _ORIG["post_process"]
    ScheduleNode.default_backward_func = _ORIG["default_backward"]
    TransformerLayerNode.backward_impl = _ORIG["backward_impl"]
    TransformerLayerNode.backward_dw = _ORIG["backward_dw"]
    _AllToAll.forward = _ORIG["a2a_forward"]
    _AllToAll.backward = _ORIG["a2a_backward"]
    MoEAlltoAllTokenDispatcher.token_dispatch = _ORIG["token_dispatch"]
    MoEAlltoAllTokenDispatcher.token_combine = _ORIG["token_combine"]
    _ORIG.clear()


def number_dispatchers(chunks: list) -> None:
    """Give each MoE layer's token dispatcher its layer number (1-based, global), for the trace of its
    all-to-alls."""
    for chunk in chunks:
        for mod in chunk.modules():
            dispatcher = getattr(getattr(mod, "mlp", None), "token_dispatcher", None)
            if dispatcher is not None and hasattr(mod, "layer_number"):
                dispatcher._k2_layer_number = mod.layer_number


def activate(hooks: OverlapHooks | None) -> None:
    """Make ``hooks`` the active ones (None: none) for the pass that starts now."""
    global _ACTIVE
    _ACTIVE = hooks
