"""Operators per microbatch of each part of a layer, for ``k2-plan``'s step-time model
(:mod:`k2.launcher.planning.step_time`): on a device bound by the cost of each operator (a CPU running a
small model; a GPU's launches) the step is that cost times these counts. torch counts operators
(``TorchDispatchMode``) but keeps no table of a model's counts, hence this one, checked against a count
of k2-train's modules by ``k2-bench bench=hardware`` (and its test).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig

#: aten operators per microbatch beyond the GEMMs (priced one launch each by
#: :mod:`k2.launcher.planning.kernels`) and core attention's batched GEMMs (:data:`ATTENTION_KERNELS`),
#: forward / backward, views included (on a CPU each costs the dispatch and the module code around it):
#: counted with torch's dispatch mode on k2-train's own modules (k2_tiny, FP32, megatron's sequential experts;
#: ``k2-bench bench=hardware`` counts them again and prints them): a dense layer 146 / 228 operators
#: (attention and its norms 125 / 186 + 7 / 14 GEMMs, the dense MLP 12 / 24 + 2 / 4 GEMMs), an MoE layer of 8
#: local experts 326 / 487 (4 local experts: 282 / 391, so 9 / 20 + 2 / 4 GEMMs per expert), the word
#: embedding 4 / 7, the final norm, output layer and loss 56 / 44 + 1 / 2 GEMMs
OPERATORS = {
    "attention": (125, 186),
    "dense_mlp": (12, 24),
    "moe": (103, 89),
    "moe_per_expert": (9, 20),
    "embedding": (4, 7),
    "loss": (56, 44),
}
#: core attention's batched GEMMs (scores, weighted values), forward / backward (counted as above)
ATTENTION_KERNELS = (2, 4)
#: the MoE layer's own operators (``OPERATORS["moe"]``: beyond attention and the experts) by megatron's
#: schedule node of the EP-overlap schedule (:mod:`k2.launcher.planning.stage_model`), forward / backward:
#: counted the same way on k2_tiny's MoE layer run node by node through megatron-core 0.19.2's
#: ``build_transformer_layer_callables`` (each node's inputs detached, as its schedule does): ``attn``
#: (pre-MLP norm, router, shared expert's element-wise part, permutation) 80 / 54, ``dispatch`` 3 / 2,
#: ``mlp`` (sorting by local expert and back, around the experts' own 9 / 20 each) 12 / 7, ``combine``
#: (un-permutation, the shared expert's add, the residual) 8 / 8. The forward adds up to the layer's 103;
#: the backward to 71 of its 89 (the rest is not attributed to a node); the model shares 103 / 89 in
#: these proportions
MOE_NODE_OPERATORS = {"attn": (80, 54), "dispatch": (3, 2), "mlp": (12, 7), "combine": (8, 8)}


def modelled_operators(model_cfg: ModelConfig, part: str, local_experts: int = 0) -> tuple[int, int]:
    """Operators the model charges a launch for, forward / backward, per microbatch of one ``part``:
    ``dense_layer``, ``moe_layer`` (with ``local_experts`` sequential experts; 0 = grouped), ``embedding``,
    ``loss`` (final norm, output layer, loss): :data:`OPERATORS` plus its GEMMs (one forward, two backward:
    input and weight gradient) and core attention's batched GEMMs. What ``k2-bench bench=hardware``
    counts on k2-train's modules is compared with this."""
    # MLA: q (down + up, or one), kv down, kv up, output
    projections = 5 if model_cfg.q_lora_rank else 4
    f, b = 0, 0

    def add(ops, gemms=0):
        nonlocal f, b
        f += ops[0] + gemms
        b += ops[1] + 2 * gemms

    if part in ("dense_layer", "moe_layer"):
        add(OPERATORS["attention"], projections)
        add(ATTENTION_KERNELS)
        if part == "dense_layer":
            add(OPERATORS["dense_mlp"], 2)
        else:
            add(OPERATORS["moe"], 1 + (2 if model_cfg.moe_shared_expert_intermediate_size else 0))
            for _ in range(local_experts):
                add(OPERATORS["moe_per_expert"], 2)
    elif part == "embedding":
        add(OPERATORS["embedding"])
    elif part == "loss":
        add(OPERATORS["loss"], 1)
    else:
        raise ValueError(part)
    return f, b
