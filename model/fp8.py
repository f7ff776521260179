"""The GEMMs in FP8 through Transformer Engine (``train.fp8_recipe``: ``blockwise`` | ``mxfp8``): what the K2
build changes for it (:mod:`k2.model.build`).

megatron-core runs FP8 training through Transformer Engine: its ``TransformerConfig`` names the format and
the recipe (:func:`fp8_fields`), its ``TransformerBlock`` runs each layer inside TE's FP8 context, and TE's
linear modules then quantise their inputs, weights and gradients. K2's layers are megatron's local layer
spec with K2's own attention, router and MLP modules (``model/build.py``); only their linear classes are
swapped for TE's (:func:`swap_linears` with :func:`te_linear_classes`), so the norms, the attention and
the activation-memory hooks stay what they are. The machine's part (CUDA, TE, the GPU generation, sequential
experts) is checked before any process group: :func:`k2.model.backends.check_fp8_recipe`.

Not run here yet: this project has no GPU with Transformer Engine; the CPU tests check the settings and
the spec walk (with stand-in classes).
"""

from __future__ import annotations

import dataclasses
from functools import partial

__all__ = ["fp8_fields", "swap_linears", "te_linear_classes"]


def fp8_fields(fp8_recipe: str | None, moe: bool) -> dict:
    """megatron's FP8 settings of the ``TransformerConfig`` for ``train.fp8_recipe``: E4M3 for activations,
    weights and gradients (``fp8='e4m3'``, as DeepSeek-V3 trains, arXiv 2412.19437 section 3.3.2, and the
    MXFP8 recipes), the recipe's scaling, and with experts the routing padded so that each expert's tokens
    fill whole quantisation blocks (``moe_router_padding_for_quantization``); none without a recipe. Its
    linears are Transformer Engine's then (:func:`te_linear_classes`); megatron's ``TransformerBlock``
    runs each layer in TE's FP8 context."""
    if fp8_recipe is None:
        return {}
    return {
        "fp8": "e4m3",
        "fp8_recipe": str(fp8_recipe),
        **({"moe_router_padding_for_quantization": True} if moe else {}),
    }


def te_linear_classes() -> dict:
    """megatron's local linear classes -> Transformer Engine's, as megatron's own backends pair them
    (``models/backends.py``: ``LocalSpecProvider`` / ``TESpecProvider`` ``column_parallel_linear`` and
    ``row_parallel_linear``): the linears Transformer Engine's FP8 recipe runs (``train.fp8_recipe``).
    Imports Transformer Engine."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return {ColumnParallelLinear: TEColumnParallelLinear, RowParallelLinear: TERowParallelLinear}


def swap_linears(spec, classes: dict):
    """A copy of the layer spec ``spec`` with every class that is a key of ``classes`` replaced by its value,
    wherever the spec names it: a ``ModuleSpec``'s module and submodules, a submodules dataclass's fields, a
    ``functools.partial``'s arguments (megatron's MoE and MLP specs). The norms, attention and router stay
    as they are: only the linears change (K2's own modules keep their activation-memory hooks)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, type):
        return classes.get(spec, spec)
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(
            spec, module=swap_linears(spec.module, classes), submodules=swap_linears(spec.submodules, classes)
        )
    if isinstance(spec, partial):
        return partial(
            swap_linears(spec.func, classes),
            *(swap_linears(a, classes) for a in spec.args),
            **{k: swap_linears(v, classes) for k, v in spec.keywords.items()},
        )
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(
            spec, **{f.name: swap_linears(getattr(spec, f.name), classes) for f in dataclasses.fields(spec) if f.init}
        )
    return spec
