"""Routed experts as grouped GEMMs (``torch._grouped_mm``) without Transformer Engine.

Why our own module: megatron-core 0.19.2 trains routed experts either with ``TEGroupedMLP`` (Transformer
Engine's grouped GEMM) or with ``SequentialMLP`` (a Python loop of one ``MLP`` per local expert, ``2 x E``
small GEMMs per forward and ``4 x E`` per backward); ``torch._grouped_mm`` appears only in its inference
code. On a GPU without TE the loop leaves the expert GEMMs far below the GEMM peak (``torch._grouped_mm``
runs K2's expert shapes at 700-780 TFLOP/s on an H200; ``docs/megatron_on_cpu.md``).

:class:`K2GroupedMLP` is :class:`k2.model.mlp.K2SequentialMLP` (megatron's ``SequentialMLP`` with the
activation-memory switches) with the same parameters -- ``local_experts.<j>.linear_fc1.weight``
``[2 x ffn, h]`` and ``local_experts.<j>.linear_fc2.weight`` ``[h, ffn]`` per expert -- so expert
parallelism, megatron's DDP / ZeRO-1 buffers, MuonClip (Newton-Schulz per matrix), distributed
checkpoints and the decoupled weight gradient (``model/wgrad.py``) see exactly what they see with
``SequentialMLP``, and checkpoints are interchangeable between the two. Only the forward differs: the
local experts' fc1 is one grouped GEMM over all permuted tokens, SwiGLU runs on all of them at once, and
fc2 is one more grouped GEMM (:func:`k2.model.mlp.mlp_forward` with grouped linears in place of the per-expert
ones, so every memory switch applies as in the sequential module).

Cost of keeping per-expert parameters: each grouped GEMM stacks the ``E`` local weight matrices into one
``[E, out, in]`` tensor (a copy of the layer's expert weights, ``E x out x in`` elements, freed right
after the GEMM) in forward and again in backward; the stacked copy is not kept between them. The weight
gradient is one grouped GEMM (``[out, T] x [T, in]`` grouped over the token dimension ->
``[E, out, in]``), handed back per expert.
"""

from __future__ import annotations

import torch

from k2.model.mlp import K2SequentialMLP, mlp_forward
from k2.model.wgrad import split_store


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


def grouped_weight_grad(
    grad_output: torch.Tensor, inputs: torch.Tensor, offs: torch.Tensor, empty: torch.Tensor | None
) -> torch.Tensor:
    """Per-expert weight gradients ``dW_e = dY_e^T X_e`` as one grouped GEMM.

    Args:
        grad_output: ``[T, out]`` contiguous, rows grouped by expert.
        inputs: ``[T, in]`` contiguous, same rows.
        offs: ``[E]`` int32 cumulative row ends.
        empty: ``[E]`` bool, True for experts with no rows (their gradient is set to 0 explicitly: a
            grouped GEMM over an empty group need not write its output), or None when none is empty.

    Returns:
        ``[E, out, in]`` in the inputs' dtype.
    """
    dw = _grouped_mm(grad_output.t(), inputs, offs)
    if empty is not None:
        dw.masked_fill_(empty.view(-1, 1, 1), 0)
    return dw


class _GroupedLinearFunction(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] W_e^T`` for every local expert ``e``, one grouped GEMM each way.

    ``forward(ctx, x [T, in], offs [E] int32, empty, linears, store, *weights [out, in])`` -> ``[T, out]``.
    Saves only ``x`` (through ``ctx.save_for_backward``, so the saved-tensor hooks of activation memory
    apply to it); the weights are re-stacked in backward. With ``store`` (a
    :class:`k2.model.wgrad.WgradStore`: the experts' linear layers were split by
    ``k2.model.wgrad.decouple_linear_wgrad``) backward returns the input gradient only and queues the
    grouped weight gradient, which accumulates into each weight and then runs each linear's DDP hooks,
    as a split linear layer does.
    """

    @staticmethod
    def forward(ctx, x, offs, empty, linears, store, *weights):
        ctx.save_for_backward(x)
        ctx.offs, ctx.empty, ctx.linears, ctx.store, ctx.weights = offs, empty, linears, store, weights
        w = torch.stack(weights)  # [E, out, in], transient
        return _grouped_mm(x, w.transpose(-2, -1), offs)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        g = grad_output.contiguous()  # (autograd may hand an expanded / strided gradient)
        x = x.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = torch.stack(ctx.weights)  # [E, out, in], transient
            grad_x = _grouped_mm(g, w, ctx.offs)
            del w
        need_w = ctx.needs_input_grad[5:]
        if not any(need_w):
            return (grad_x, None, None, None, None, *([None] * len(need_w)))
        if ctx.store is not None:
            from k2.model.wgrad import DeferredWgrad, accumulate_weight_grad, run_wgrad_hooks

            weights, linears, offs, empty = ctx.weights, ctx.linears, ctx.offs, ctx.empty

            def run(g=g, x=x):
                dw = grouped_weight_grad(g, x, offs, empty)
                for w_e, lin, d in zip(weights, linears, dw.unbind(0)):
                    accumulate_weight_grad(w_e, d)
                    run_wgrad_hooks(lin)

            ctx.store.put(DeferredWgrad(run, [x, g], ctx.store.tag))
            return (grad_x, None, None, None, None, *([None] * len(need_w)))
        dw = grouped_weight_grad(g, x, ctx.offs, ctx.empty)
        return (grad_x, None, None, None, None, *(d if n else None for d, n in zip(dw.unbind(0), need_w)))


class _GroupedLinear:
    """The ``linear_fc1`` / ``linear_fc2`` of all local experts as one callable with megatron's
    ``(output, bias)`` return (what :func:`k2.model.mlp.mlp_forward` calls)."""

    def __init__(self, linears: list, offs: torch.Tensor, empty: torch.Tensor | None):

        self.linears, self.offs, self.empty = linears, offs, empty
        self.weights = [lin.weight for lin in linears]
        stores = {id(split_store(lin)) for lin in linears}
        if len(stores) != 1:
            raise RuntimeError(
                "K2GroupedMLP: the local experts' linear layers are split for the decoupled "
                "weight gradient only in part"
            )
        self.store = split_store(linears[0])

    def __call__(self, x: torch.Tensor):
        y = _GroupedLinearFunction.apply(x, self.offs, self.empty, self.linears, self.store, *self.weights)
        return y, None


class _Experts:
    """What :func:`k2.model.mlp.mlp_forward` reads from an ``MLP``: ``linear_fc1`` and ``linear_fc2``."""

    def __init__(self, linear_fc1, linear_fc2):
        self.linear_fc1, self.linear_fc2 = linear_fc1, linear_fc2


class K2GroupedMLP(K2SequentialMLP):
    """Routed experts with megatron ``SequentialMLP``'s parameters and interface, computed as grouped
    GEMMs (see the module docstring). Selected by ``k2.model.moe_grouped_gemm`` (``model/build.py``).

    ``forward(permuted_local_hidden_states [T, h], tokens_per_expert [E], permuted_probs [T])`` ->
    ``([T, h], None)``; tokens grouped by local expert as megatron's token dispatchers deliver them.

    Raises:
        ValueError: fp8/fp4 GEMMs, ``moe_apply_probs_on_input``, expert tensor parallelism, biases, or
            widths whose rows are not 16-byte aligned (``torch._grouped_mm`` needs ``hidden_size`` and
            ``moe_ffn_hidden_size`` multiples of 8 in bf16, of 4 in fp32; ``k2.launcher.training.prepare.prepare_run``
            asks for multiples of 8).
        RuntimeError: forward hooks on the experts' linear layers (the grouped forward does not call
            those modules, so their hooks would be skipped silently).
    """

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ):
        if self.config.fp8 or self.config.fp4 or self.config.moe_apply_probs_on_input:
            raise ValueError("K2GroupedMLP: fp8/fp4 GEMMs and moe_apply_probs_on_input are not supported")
        if self.num_local_experts == 1:  # one expert: one GEMM each way already
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        if self.tp_group is not None and self.tp_group.size() > 1:
            raise ValueError("K2GroupedMLP: expert tensor parallelism is not supported (expert TP must be 1)")
        x = permuted_local_hidden_states.contiguous()
        fc1 = [e.linear_fc1 for e in self.local_experts]
        fc2 = [e.linear_fc2 for e in self.local_experts]
        align = 16 // x.element_size()
        for lin in fc1 + fc2:
            if lin.bias is not None:
                raise ValueError("K2 MLPs have no biases (model.add_bias_linear is off)")
            if lin._forward_pre_hooks or lin._forward_hooks:
                raise RuntimeError(
                    f"K2GroupedMLP: forward hooks on {type(lin).__name__} of an expert would "
                    "not run (the grouped forward does not call the linear modules)"
                )
        out1, h = fc1[0].weight.shape
        if h % align or out1 % align or fc2[0].weight.shape[1] % align:
            raise ValueError(
                f"K2GroupedMLP: torch._grouped_mm needs 16-byte aligned rows: model.hidden_size={h} and "
                f"model.moe_ffn_hidden_size={fc2[0].weight.shape[1]} must be multiples of {align} in "
                f"{x.dtype} (set model.moe_grouped_gemm=false for other widths)"
            )
        counts = tokens_per_expert
        offs = torch.cumsum(counts.to(x.device), 0, dtype=torch.int32)
        if counts.device.type == "cpu":  # megatron's dispatchers hand the counts on the host: no sync
            empty = (counts == 0).to(x.device) if bool((counts == 0).any()) else None
        else:
            empty = counts == 0
        experts = _Experts(_GroupedLinear(fc1, offs, empty), _GroupedLinear(fc2, offs, empty))
        return mlp_forward(experts, x, permuted_probs, self.memory, routed=True), None
