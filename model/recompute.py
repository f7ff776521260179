"""Selective recompute: megatron's output-discarding checkpoint, done through the saved-tensor hooks.

docs/k2_reference.md "Training system", "Activation memory": K2 recomputes cheap, memory-heavy stages (RMSNorm,
SwiGLU, MLA up-projection, MoE down-projection) instead of keeping their outputs for backward.

megatron-core's ``recompute_modules`` ``layernorm`` and ``mla_up_proj`` choose *what* to recompute (the
two RMSNorms of a layer; MLA's up-projections + RoPE) and run it under
``tensor_parallel.CheckpointWithoutOutput``: the function runs without autograd, its output's storage is
released after the consumers' forward (``storage.resize_(0)``) and refilled by a grad hook on a later
tensor (``discard_output_and_register_recompute``). On the CPU proxy that mechanism fails: in one
process, a forward/backward of ``k2_tiny`` without recompute followed by two with ``layernorm`` ends in a
segmentation fault in backward (the norm's saved input is found released when its recompute runs), and
``mla_up_proj`` after other runs fails with "setStorage ... out of bounds for storage of size 0" in core
attention's backward: a released storage read before the grad hook refilled it. Which run fails depends
on Python's garbage collection (with ``gc.disable()`` it passes) and not on megatron's C++
``share_storage`` (a plain storage copy in its place fails the same way); we did not find the root
cause.

:class:`CheckpointWithoutOutput` here has megatron's interface and semantics but releases nothing behind
autograd's back: its function's own backward keeps only the inputs (a reentrant checkpoint,
:class:`_OutputRecompute`), and its outputs are marked with
:func:`k2.model.saved_tensors.mark_recompute`, so every consumer that saves an output for backward gets it
recomputed from those inputs instead of keeping it. No grad hook, no storage resizing; the saved inputs
go through the same hooks as every saved tensor (FP8 storage, offload). :class:`K2TransformerLayer` and
:class:`K2MLASelfAttention` are megatron's classes with this checkpoint in place of megatron's (megatron
creates one per forward in ``input_layernorm_checkpoint`` / ``pre_mlp_norm_checkpoint`` /
``qkv_up_checkpoint``); everything else, including where megatron checkpoints, is megatron's.
:func:`recompute_output` is the same for one function call (SwiGLU, ``model/mlp.py``).

Outside a :class:`k2.model.saved_tensors.SavedTensorScope` (the model installs one per layer when any of
these is on, ``model/activation_memory.py``) the outputs are saved as usual: correct, without the saving.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_layer import TransformerLayer

from k2.model.saved_tensors import SavedTensorScope, mark_recompute


class _OutputRecompute(torch.autograd.Function):
    """``fn(*inputs)`` (one tensor or a tuple) saving only ``inputs``; backward re-runs ``fn`` with autograd.
    ``fn`` must be deterministic (no dropout)."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        inputs = [
            t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and need else t
            for t, need in zip(saved, needs)
        ]
        with torch.enable_grad():
            outs = ctx.fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(t.grad if isinstance(t, torch.Tensor) and need else None for t, need in zip(inputs, needs)))


class _Recomputed:
    """Recompute of a node's outputs, shared by the consumers of all of them: one ``fn`` call serves every
    output (e.g. MLA's q, k, v), each handed out once."""

    def __init__(self, node):
        self.node = node
        self.pending: dict | None = None

    def output(self, i: int) -> torch.Tensor:
        if self.pending is None or i not in self.pending:
            outs = self.node.fn(*self.node.saved_tensors)
            outs = outs if isinstance(outs, tuple) else (outs,)
            self.pending = dict(enumerate(outs))
        return self.pending.pop(i)


def recompute_output(fn: Callable, *inputs: torch.Tensor | None, site: str):
    """``fn(*inputs)``, keeping only ``inputs`` for backward (see the module docstring).

    Args:
        fn: deterministic function of ``inputs`` (may use module parameters) returning a tensor or a
            tuple of tensors (each contiguous).
        inputs: tensors (or None) passed to ``fn``.
        site: the recompute site (``config/schema.py`` ``MEMORY_RECOMPUTE_SITES``), for the meter.

    Returns:
        ``fn(*inputs)``; without grad mode just that.
    """
    if not torch.is_grad_enabled():
        return fn(*inputs)
    outs = _OutputRecompute.apply(fn, *inputs)
    single = isinstance(outs, torch.Tensor)
    seq = (outs,) if single else outs
    shared = _Recomputed(seq[0].grad_fn)
    for i, out in enumerate(seq):
        mark_recompute(out, lambda i=i: shared.output(i), site)
    return outs


class CheckpointWithoutOutput:
    """Drop-in for megatron's ``tensor_parallel.CheckpointWithoutOutput`` (same two calls) on
    :func:`recompute_output`: the outputs are never kept by their consumers, so there is nothing to
    release or refill."""

    def __init__(self, site: str):
        self.site = site

    def checkpoint(self, run_function: Callable, *args):
        return recompute_output(run_function, *args, site=self.site)

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Nothing to do (megatron releases the outputs here)."""


def _checkpoint_slot(name: str, site: str) -> property:
    """A property for megatron's per-forward ``self.<name> = tensor_parallel.CheckpointWithoutOutput()``:
    the assigned megatron object is replaced by ours."""

    def get(self):
        return self.__dict__.get("_k2_" + name)

    def set_(self, value):
        self.__dict__["_k2_" + name] = None if value is None else CheckpointWithoutOutput(site)

    return property(get, set_)


_RERUN = threading.local()


def recomputing() -> bool:
    """True while a whole-layer recompute re-runs a layer in backward (:func:`recompute_layer`): code with
    side effects that must happen once per forward (QK-Clip's max-logit recording) skips them then."""
    return getattr(_RERUN, "depth", 0) > 0


class _LayerRecompute(torch.autograd.Function):
    """``fn(x)`` keeping only ``x`` for backward; backward re-runs ``fn`` with autograd on (megatron's
    ``tensor_parallel.checkpoint``, reentrant, without RNG bookkeeping: K2 has no dropout)."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        out = fn(x)  # under no_grad (autograd's custom Function forward): nothing inside is saved
        ctx.save_for_backward(x)  # after fn: the input's site marks (offload=attn_input) are set by then
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(ctx.needs_input_grad[1])
        _RERUN.depth = getattr(_RERUN, "depth", 0) + 1
        try:  # in a scope of its own: FP8 storage and the selective recompute sites act, offload does not
            with torch.enable_grad(), SavedTensorScope("layer re-run", offload=False):
                out = ctx.fn(x)
        finally:
            _RERUN.depth -= 1
        torch.autograd.backward(out, grad)
        return None, x.grad if ctx.needs_input_grad[1] else None


def recompute_layer(fn: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
    """Whole-layer recompute (``memory.recompute`` site ``layer``; megatron's ``recompute_granularity=full``
    with one layer per checkpoint): ``fn(hidden_states)`` runs without autograd and only
    ``hidden_states [s, b, h]`` is saved (through the saved-tensor hooks: offload ``attn_input`` moves it
    to host); backward re-runs ``fn`` with autograd and back-propagates through the re-run.

    The re-run has a saved-tensor scope of its own in which FP8 storage and the selective recompute sites act on
    its tensors (they live one layer at a time) and offload does not (they are used right away). Side effects
    happen once: megatron's router counts (``local_tokens_per_expert``), its aux loss and
    :class:`k2.model.router.K2Router`'s token counts run only with grad enabled, i.e. in the re-run; the
    max-logit recording only outside it (:func:`recomputing`). Decoupled weight gradients (``model/wgrad.py``)
    are queued by the re-run's backward as by a plain one.

    Args:
        fn: the layer's forward from its input (deterministic; may use parameters and other tensors it
            closes over, which stay referenced until backward).
        hidden_states: the layer input ``[s, b, h]``.

    Returns:
        ``fn(hidden_states)``; without grad mode just that.
    """
    if not torch.is_grad_enabled():
        return fn(hidden_states)
    return _LayerRecompute.apply(fn, hidden_states)


class K2TransformerLayer(TransformerLayer):
    """megatron ``TransformerLayer``; its ``layernorm`` recompute (``recompute_modules``) runs on
    :class:`CheckpointWithoutOutput` (this module), and with ``recompute_whole_layer`` (set by
    ``k2.model.activation_memory.set_memory_options`` for ``memory.recompute`` site ``layer``) a training
    forward is :func:`recompute_layer`. ``memory``: the layer's
    :class:`k2.model.activation_memory.MemoryOptions` (same setter; None = all off), read by its site hooks
    per forward. After each forward (and each re-run) the MoE token dispatcher's router probabilities are
    released (:meth:`_release_dispatch_probs`)."""

    input_layernorm_checkpoint = _checkpoint_slot("input_layernorm_checkpoint", "layernorm")
    pre_mlp_norm_checkpoint = _checkpoint_slot("pre_mlp_norm_checkpoint", "layernorm")
    recompute_whole_layer = False
    memory = None

    def _release_dispatch_probs(self) -> None:
        """Drop megatron's alltoall token dispatcher's ``self.probs`` (set by ``dispatch_preprocess``, read
        only later in the same forward) once the layer's forward is done.

        Kept, the router probabilities ``[T, E]`` hold their autograd graph until the layer's next forward,
        and that graph's ``AccumulateGrad`` node holds the leaf the layer was run on: a pipeline stage's
        received input, or under whole-layer recompute the re-run's ``x.detach()`` (:class:`_LayerRecompute`),
        which shares the layer input's storage. Each MoE layer would so keep one input ``[s, b, h]`` alive
        past its backward (at K2's scale ``[4096, 1, 7168]`` BF16, 58.7 MB per layer)."""
        dispatcher = getattr(getattr(self, "mlp", None), "token_dispatcher", None)
        if dispatcher is not None and getattr(dispatcher, "probs", None) is not None:
            dispatcher.probs = None

    def forward(self, *args, **kwargs):
        if not (self.recompute_whole_layer and self.training and torch.is_grad_enabled()):
            out = super().forward(*args, **kwargs)
            self._release_dispatch_probs()
            return out
        if "hidden_states" in kwargs:  # how megatron's TransformerBlock calls its layers
            hidden, rest = kwargs.pop("hidden_states"), args
        else:
            hidden, rest = args[0], args[1:]
        context = kwargs.get("context")

        def run(x):
            out, _ = TransformerLayer.forward(self, x, *rest, **kwargs)
            self._release_dispatch_probs()
            return out

        return recompute_layer(run, hidden), context


class K2MLASelfAttention(MLASelfAttention):
    """megatron ``MLASelfAttention``; its ``mla_up_proj`` recompute (``recompute_modules``) runs on
    :class:`CheckpointWithoutOutput` (this module)."""

    qkv_up_checkpoint = _checkpoint_slot("qkv_up_checkpoint", "mla_up_proj")

    def _resolve_qk_norm_config(self, submodules):
        """megatron's choice of the Q / KV latent norms and projections, except for a query without a latent
        (``q_lora_rank`` null: Moonlight-16B-A3B, DeepSeek-V2-Lite) with the latent norms on: megatron-core
        0.19.2 then asks for a fused norm + linear query projection, which only Transformer Engine has, and
        which adds a norm the Hugging Face models do not have (their ``q_proj`` reads the layer's normalised
        input). Here the query projection is the spec's linear without a norm, and the KV latent's norm and
        up-projection are what megatron resolves for a model with a query latent."""
        if self.config.q_lora_rank is not None or not self.config.qk_layernorm:
            return super()._resolve_qk_norm_config(submodules)
        with_latent = copy.copy(self.config)
        with_latent.q_lora_rank = 1  # (resolves the KV side as for a model with a query latent and norm)
        kv = QKNormConfigResolver(
            with_latent, dataclasses.replace(submodules, q_layernorm=submodules.kv_layernorm)
        ).resolve()
        return {
            **kv,
            "linear_q_proj": submodules.linear_q_proj,
            "linear_q_up_proj": IdentityOp,
            "q_layernorm": IdentityOp,
        }
