"""Decoupled weight gradients: the backward of megatron's linear layers split into dgrad now, wgrad later.

K2 report, "Training system" (docs/k2_reference.md): in the interleaved 1F1B schedule each microbatch's backward
computes the input gradient first, hands it to the previous pipeline stage, and computes the weight
gradients while that send/receive is in flight. This module is the model side of that: the backward of
each linear layer of the decoder (MLA's q/kv down and up projections and output projection, the dense
SwiGLU MLP, every routed expert's MLP, the shared expert) computes only ``dgrad = grad_output @ W`` and
puts the weight gradient ``wgrad = grad_output^T @ input`` (and the bias gradient, if any) into a per-rank
:class:`WgradStore`, with the two tensors it needs. The schedule side (``schedules/pipeline.py``) drains
the store after it has posted the send of the input gradient and before it waits on it.

Why our own code: megatron-core 0.19.2's ``delay_wgrad_compute`` exists only in Transformer Engine's
linear layers (``TELinear.backward_dw``) and only inside the combined-1F1B EP-overlap schedule
(``overlap_moe_expert_parallel_comm``, TE >= 2.10 for MoE); megatron's own ``ColumnParallelLinear`` /
``RowParallelLinear`` -- the layers of the local (non-TE) specs the CPU proxy and our GPU runs use --
have a ``backward_dw`` that does nothing. What we reuse from megatron: its DDP hook point for delayed
wgrads (``DistributedDataParallelConfig.delay_wgrad_compute`` + ``param.skip_backward_post_hook`` ->
``module.register_wgrad_accumulation_and_reduce_hooks``), so the DDP grad-ready hook of a weight (add
``param.grad`` into ``param.main_grad``; with ``overlap_grad_reduce`` also ``register_grad_ready``) runs
right after its deferred wgrad, exactly as it would after autograd's accumulation; and megatron's own
``prepare_input_tensors_for_wgrad_compute``. The dgrad and wgrad products are the same calls as
megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` backward, so gradients are bitwise equal.

Memory: the layer's input is saved for backward with ``ctx.save_for_backward`` as megatron's does, so the
saved-tensor hooks of activation memory (FP8 storage, CPU offload; config group ``memory``) apply to it
between forward and backward unchanged; the backward unpacks it (as megatron's backward does) and the
store holds the unpacked input and the output gradient until the wgrad runs -- within the same
microbatch's backward step, so at most one microbatch's deferred tensors are alive
(:attr:`WgradStore.peak_bytes`).
"""

from __future__ import annotations

import time
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "WgradStore",
    "WgradItem",
    "DeferredWgrad",
    "decouple_linear_wgrad",
    "decoupled_modules",
    "check_ddp_hooks",
    "split_store",
    "accumulate_weight_grad",
    "run_wgrad_hooks",
]

#: attribute set on every linear module whose backward is split
_SPLIT_ATTR = "_k2_wgrad_store"


@dataclass
class WgradItem:
    """One deferred weight-gradient computation.

    Attributes:
        module: the megatron ``ColumnParallelLinear`` / ``RowParallelLinear``.
        weight: its weight ``[out, in]``; bias: its bias ``[out]`` or None.
        input: the layer input as 2-D ``[tokens, in]`` (contiguous).
        grad_output: the output gradient as 2-D ``[tokens, out]`` (contiguous).
        accumulate_into_main_grad: megatron's ``gradient_accumulation_fusion`` was set for the call and
            the weight has ``main_grad``: add into it directly (then ``grad_added_to_main_grad``).
        tag: ``(model chunk, microbatch)`` of the backward step that queued it (None outside a schedule).
    """

    module: torch.nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None
    input: torch.Tensor
    grad_output: torch.Tensor
    accumulate_into_main_grad: bool
    tag: tuple | None
    nbytes: int = 0  # bytes held by the deferred tensors (input + output gradient); set on creation

    def __post_init__(self):
        self.nbytes = (
            self.input.numel() * self.input.element_size() + self.grad_output.numel() * self.grad_output.element_size()
        )


@dataclass
class DeferredWgrad:
    """A deferred weight-gradient computation given as a function (the grouped-GEMM experts,
    ``model/grouped_mlp.py``: one grouped GEMM for all local experts' weights, then each linear's hooks).

    Attributes:
        run: computes and accumulates the gradients and runs the DDP hooks (:func:`accumulate_weight_grad`,
            :func:`run_wgrad_hooks`).
        tensors: the tensors it holds (for the byte accounting).
        tag: as :attr:`WgradItem.tag`.
    """

    run: Callable[[], None]
    tensors: list
    tag: tuple | None
    nbytes: int = 0

    def __post_init__(self):
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)


class WgradStore:
    """Per-rank FIFO of deferred weight gradients (K2 report, "Training system").

    The linear layers' backward :meth:`put` items; the pipeline schedule hook (``schedules/pipeline.py``)
    sets :attr:`tag` to the ``(chunk, microbatch)`` whose backward runs and calls :meth:`drain` after the
    send of that microbatch's input gradient was posted. ``drain`` runs the items in the order they were
    queued, so the accumulation into each weight's gradient happens in the same order as without the split.

    Accounting (bytes of the deferred input + output-gradient tensors): :attr:`held_bytes` now,
    :attr:`peak_bytes` since :meth:`reset_peak`, :attr:`max_tags_held` = most distinct tags queued at once
    (1 when the queue drains every microbatch).
    """

    def __init__(self):
        self.queue: deque[WgradItem] = deque()
        self.tag: tuple | None = None
        self.held_bytes = 0
        self.peak_bytes = 0
        self.max_tags_held = 0
        self._tags: dict = {}
        #: called after each :meth:`drain` that ran items: ``on_drain(tags, n_items, nbytes, start, end,
        #: where)`` (``time.time()`` seconds); the pipeline trace records W events with it
        self.on_drain: Callable | None = None

    def __len__(self) -> int:
        return len(self.queue)

    def put(self, item: WgradItem) -> None:
        """Queue one deferred weight gradient."""
        self.queue.append(item)
        self.held_bytes += item.nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self._tags[item.tag] = self._tags.get(item.tag, 0) + 1
        self.max_tags_held = max(self.max_tags_held, len(self._tags))

    def reset_peak(self) -> None:
        """Start a new accounting window (the schedule hook does so at each forward-backward pass)."""
        self.peak_bytes = self.held_bytes
        self.max_tags_held = len(self._tags)

    def drain(self, where: str = "") -> int:
        """Run every queued weight gradient, oldest first; returns how many ran.

        Args:
            where: why it drains now (recorded by :attr:`on_drain`): ``after_send`` (the send of the
                input gradient was posted), ``no_send`` (the first stage: nothing to send), ``late``
                (left over when the next forward or backward starts), ``flush`` (before the grad
                reduction / at the end of the pass). The last two should never run anything.
        """
        if not self.queue:
            return 0
        start = time.time()
        n, nbytes, tags = 0, 0, []
        while self.queue:
            item = self.queue.popleft()
            _run_wgrad(item)
            n += 1
            nbytes += item.nbytes
            self.held_bytes -= item.nbytes
            if item.tag not in tags:
                tags.append(item.tag)
            left = self._tags[item.tag] - 1
            if left:
                self._tags[item.tag] = left
            else:
                del self._tags[item.tag]
        end = time.time()
        if self.on_drain is not None:
            self.on_drain(tags, n, nbytes, start, end, where)
        return n


def accumulate_weight_grad(param: torch.Tensor | None, grad: torch.Tensor) -> None:
    """What autograd's AccumulateGrad does for a leaf: ``param.grad += grad`` (or set it); a weight
    ``[out, in]`` or a bias ``[out]``; nothing for ``param=None``."""
    if param is None:
        return
    if param.grad is None:
        param.grad = grad
    else:
        param.grad = param.grad + grad


def split_store(module) -> WgradStore | None:
    """The :class:`WgradStore` of a linear layer whose backward :func:`decouple_linear_wgrad` split, or
    None."""
    return getattr(module, _SPLIT_ATTR, None)


def run_wgrad_hooks(module) -> None:
    """The DDP grad-ready hooks of a split module's parameters (after their gradients are set)."""
    for hook in getattr(module, "_k2_wgrad_hooks", ()):
        hook()


def _run_wgrad(item) -> None:
    """The weight (and bias) gradient of one item, then the DDP hooks of the module's parameters.

    Same products as megatron's ``LinearWithGradAccumulationAndAsyncCommunication.backward``:
    ``grad_output.t().matmul(input)`` (or accumulated into ``main_grad`` when fused) and
    ``grad_output.sum(dim=0)``. A :class:`DeferredWgrad` runs its function.
    """
    if isinstance(item, DeferredWgrad):
        item.run()
        return
    weight = item.weight
    if item.accumulate_into_main_grad:
        weight.main_grad.addmm_(item.grad_output.t().to(weight.main_grad.dtype), item.input.to(weight.main_grad.dtype))
        weight.grad_added_to_main_grad = True
    else:
        accumulate_weight_grad(weight, item.grad_output.t().matmul(item.input))
    if item.bias is not None and item.bias.requires_grad:
        accumulate_weight_grad(item.bias, item.grad_output.sum(dim=0))
    run_wgrad_hooks(item.module)  # megatron DDP's backward post-hook: main_grad += param.grad; grad = None


def _custom_fwd_bwd():
    # megatron's autocast-aware decorators (same as its linear Function uses)
    from megatron.core.tensor_parallel.layers import custom_bwd, custom_fwd

    return custom_fwd, custom_bwd


def _linear_function():
    """The autograd Function, built on first use (megatron is imported lazily, after cpu_backend)."""
    global _LinearDgradNow
    if _LinearDgradNow is not None:
        return _LinearDgradNow
    custom_fwd, custom_bwd = _custom_fwd_bwd()

    class LinearDgradNowWgradLater(torch.autograd.Function):
        """``y = x W^T (+ b)``; backward returns ``dx = dy W`` and queues ``dW = dy^T x`` (and ``db``).

        Shapes: ``x [..., in]``, ``W [out, in]``, ``y [..., out]``. With ``allreduce_dgrad`` (tensor
        parallelism without sequence parallelism) ``dx`` is all-reduced over ``tp_group`` before it is
        returned, as megatron's does.
        """

        @staticmethod
        @custom_fwd
        def forward(ctx, input, weight, bias, fused, allreduce_dgrad, tp_group, module, store):
            ctx.save_for_backward(input, weight)  # saved-tensor hooks (FP8 storage, offload) apply
            # the parameter itself: under saved-tensor hooks ctx.saved_tensors gives back a copy, and
            # the deferred wgrad must accumulate into the parameter (megatron keeps main_grad likewise)
            ctx.weight_param = weight
            ctx.fused = bool(fused) and hasattr(weight, "main_grad")
            ctx.allreduce_dgrad = allreduce_dgrad
            ctx.tp_group = tp_group
            ctx.module = module
            ctx.store = store
            ctx.bias = bias
            output = torch.matmul(input, weight.t())
            if bias is not None:
                output = output + bias
            return output

        @staticmethod
        @custom_bwd
        def backward(ctx, grad_output):
            from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

            input, weight = ctx.saved_tensors
            grad_input = grad_output.matmul(weight)
            handle = None
            if ctx.allreduce_dgrad:
                handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
            g2, x2 = prepare_input_tensors_for_wgrad_compute(grad_output, input)
            store = ctx.store
            store.put(WgradItem(ctx.module, ctx.weight_param, ctx.bias, x2, g2, ctx.fused, store.tag))
            if handle is not None:
                handle.wait()
            return grad_input, None, None, None, None, None, None, None

    _LinearDgradNow = LinearDgradNowWgradLater
    return _LinearDgradNow


_LinearDgradNow = None


def _split_forward_impl(
    self,
    input,
    weight,
    bias=None,
    gradient_accumulation_fusion=False,
    allreduce_dgrad=False,
    sequence_parallel=False,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
    tp_group=None,
    gtp_remat_size=1,
):
    """Replacement of ``ColumnParallelLinear._forward_impl`` / ``RowParallelLinear._forward_impl``
    (same keyword arguments) for a module whose backward is split; frozen weights and call shapes the
    split does not cover go to megatron's own implementation."""
    store = getattr(self, _SPLIT_ATTR)
    if (
        not weight.requires_grad
        or weight is not self.weight
        or sequence_parallel
        or grad_output_buffer is not None
        or gtp_remat_size > 1
    ):
        return type(self)._forward_impl(
            self,
            input,
            weight,
            bias=bias,
            gradient_accumulation_fusion=gradient_accumulation_fusion,
            allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=sequence_parallel,
            grad_output_buffer=grad_output_buffer,
            wgrad_deferral_limit=wgrad_deferral_limit,
            tp_group=tp_group,
            gtp_remat_size=gtp_remat_size,
        )
    return _linear_function().apply(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, tp_group, self, store
    )


def _register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
    """megatron DDP's hook point for delayed wgrads (``ddp_config.delay_wgrad_compute``): DDP passes the
    backward post-hook of each of this module's parameters marked ``skip_backward_post_hook``; the
    deferred wgrad runs them after it has set the gradients."""
    self._k2_wgrad_hooks.append(hook)


def decouple_linear_wgrad(chunks: list, store: WgradStore) -> list:
    """Split the backward of every linear layer in the decoder of ``chunks`` (dgrad now, wgrad queued).

    Covers each megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` under ``decoder.layers``:
    MLA's ``linear_q_down_proj``, ``linear_q_up_proj``, ``linear_kv_down_proj``, ``linear_kv_up_proj``,
    ``linear_proj``; the dense MLP's and every local expert's and the shared expert's ``linear_fc1`` /
    ``linear_fc2``. (The router's gate, the embedding and the output head keep their backward.)

    Call it on the unwrapped model chunks *before* megatron's DDP wraps them, and build the DDP with
    ``delay_wgrad_compute=True`` (``k2.parallel.distributed.wrap_model``): the parameters are marked
    ``skip_backward_post_hook``, so DDP registers their grad-ready hooks on the module
    (``register_wgrad_accumulation_and_reduce_hooks``) instead of on autograd's accumulator.

    Args:
        chunks: this rank's model chunks (``GPTModel`` or wrapped).
        store: the rank's :class:`WgradStore`.

    Returns:
        the modules whose backward is split.

    Raises:
        ValueError: a layer with sequence parallelism (its wgrad needs the all-gathered input; not
            supported here).
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    out = []
    for chunk in chunks:
        for name, mod in chunk.named_modules():
            if ".layers." not in f".{name}." or not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if getattr(mod, "sequence_parallel", False):
                raise ValueError(f"{name}: decoupled wgrad does not support sequence parallelism")
            if getattr(mod, _SPLIT_ATTR, None) is not None:
                continue
            setattr(mod, _SPLIT_ATTR, store)
            mod._k2_wgrad_hooks = []
            mod._forward_impl = types.MethodType(_split_forward_impl, mod)
            mod.register_wgrad_accumulation_and_reduce_hooks = types.MethodType(
                _register_wgrad_accumulation_and_reduce_hooks, mod
            )
            for p in _deferred_params(mod):
                p.skip_backward_post_hook = True
            out.append(mod)
    return out


def _deferred_params(mod) -> list:
    """The parameters whose gradient the deferred wgrad of ``mod`` produces: the weight, and the bias
    when megatron passes it into the linear function (``ColumnParallelLinear`` without
    ``skip_bias_add``; ``RowParallelLinear`` adds its bias after the all-reduce, outside it)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    out = [mod.weight] if mod.weight is not None and mod.weight.requires_grad else []
    bias = getattr(mod, "bias", None)
    if (
        isinstance(mod, ColumnParallelLinear)
        and not mod.skip_bias_add
        and isinstance(bias, torch.nn.Parameter)
        and bias.requires_grad
    ):
        out.append(bias)
    return out


def check_ddp_hooks(model: list) -> int:
    """Check that megatron's DDP registered its grad-ready hook of every deferred parameter on the
    module (built with ``delay_wgrad_compute=True``); returns the number of modules checked.

    Raises:
        RuntimeError: a module with a split backward whose hooks are missing (its deferred gradients
            would never reach the DDP grad buffer).
    """
    mods = decoupled_modules(model)
    for m in mods:
        if len(m._k2_wgrad_hooks) != len(_deferred_params(m)):
            raise RuntimeError(
                f"{type(m).__name__}: {len(m._k2_wgrad_hooks)} DDP wgrad hooks registered for "
                f"{len(_deferred_params(m))} deferred parameters; wrap the model with megatron DDP "
                "built with delay_wgrad_compute=True (parallel.distributed.wrap_model)"
            )
    return len(mods)


def decoupled_modules(model: list) -> list:
    """The modules of ``model`` (chunks, wrapped or not) whose backward :func:`decouple_linear_wgrad`
    split."""
    return [m for chunk in model for m in chunk.modules() if getattr(m, _SPLIT_ATTR, None) is not None]
