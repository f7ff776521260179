"""The parameters of each model chunk as megatron's buffer-layout functions see them, for
:mod:`k2.launcher.planning.memory` to lay out without building the model.

Each PP rank's model chunks get their parameter list (names and shapes from :func:`k2.model.params.count_params`'s
meta-device model; routed experts ``num_moe_experts / ep`` per GPU; the TP-sharded ones at ``1 / tp`` of their
shape), as :class:`LayoutParam` stand-ins tagged like the trainer tags the parameters (``allreduce=False`` on
expert parameters when ``ep > 1``; ``is_managed_by_layer_wise_optimizer`` -- megatron's buffer key that gives them
buffers of their own -- on the Muon matrices of ``optim=muonclip`` under ZeRO-1, routed by
:func:`k2.optim.params.route`; ``shared_embedding`` on tied embeddings).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

from k2.model.params import tp_sharded
from k2.optim.params import route

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig

__all__ = ["LayoutParam", "chunk_kinds", "chunk_params"]


def _route_cfg(model_cfg: ModelConfig):
    """What :func:`k2.optim.params.route` reads from megatron's ``TransformerConfig`` (SwiGLU is always on)."""
    return types.SimpleNamespace(
        gated_linear_unit=True,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=None,
        kv_channels=None,
    )


class LayoutParam:
    """Stand-in for a ``torch.nn.Parameter`` in megatron's buffer-layout functions, which read only
    ``requires_grad``, ``dtype``, ``data.nelement()`` and attributes (``allreduce``,
    ``is_managed_by_layer_wise_optimizer``, ``shared_embedding``). A plain object: tens of thousands of
    them (K2 on few GPUs) cost milliseconds, where meta tensors cost seconds.

    Attributes:
        spec: the :class:`k2.model.params.ParamSpec`.
        name: full parameter name in its chunk (``decoder.layers.<local i>....``).
        k2_optimizer: ``"muon"`` or ``"adamw"``.
    """

    requires_grad = True
    # megatron's tags, set only where the trainer sets them (megatron reads them with getattr and a default)
    allreduce: bool
    is_managed_by_layer_wise_optimizer: bool
    shared_embedding: bool

    def __init__(self, spec, name: str, dtype):
        self.spec, self.name, self.dtype = spec, name, dtype
        self.shape = spec.shape
        self._numel = spec.numel
        self.k2_optimizer = "adamw"

    @property
    def data(self) -> LayoutParam:
        return self

    def nelement(self) -> int:
        return self._numel

    numel = nelement

    def dim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"LayoutParam({self.name}, {self.shape})"


def chunk_params(
    counts,
    kinds: tuple,
    has_embedding: bool,
    has_loss: bool,
    ep: int,
    *,
    precision: str,
    muon: bool,
    layer_wise: bool,
    model_cfg: ModelConfig,
    router_optimizer: str = "muon",
    default_route: str = "adamw",
    tp: int = 1,
) -> list[LayoutParam]:
    """The parameters of one model chunk in ``GPTModel.named_parameters`` order: the embedding, the layers
    (``kinds``: per local layer ``"dense_layer"`` / ``"moe_layer"``, routed experts ``num_moe_experts /
    ep``), the final norm and output head, the TP-sharded ones at ``1 / tp`` of their shape
    (:func:`k2.model.params.tp_sharded`); tagged as the trainer tags the real parameters."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rcfg = _route_cfg(model_cfg)
    local_experts = counts.num_experts // ep if counts.num_experts else 0
    specs = counts.specs

    def make(spec, layer_index: int | None):
        name = (
            spec.name
            if layer_index is None
            else spec.name.replace("decoder.layers.0.", f"decoder.layers.{layer_index}.", 1)
        )
        p = LayoutParam(spec, name, dtype)
        if tp > 1 and tp_sharded(name):  # a row-parallel weight splits its input dim, the others their output dim
            axis = 1 if ("linear_proj." in name or "linear_fc2." in name) else 0
            p.shape = tuple(d // tp if j == axis else d for j, d in enumerate(p.shape))
            p._numel = spec.numel // tp
        p.k2_optimizer = default_route
        if muon:
            p.k2_optimizer = route(spec.name, p, rcfg, router_optimizer)[0]
        if spec.expert is not None and ep > 1:
            p.allreduce = False  # megatron: expert parameters reduce over the expert-DP group
        if layer_wise:
            p.is_managed_by_layer_wise_optimizer = p.k2_optimizer == "muon"
        if counts.tied_embeddings and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            p.shared_embedding = True
        return p

    params = [make(s, None) for s in specs["embedding"]] if has_embedding else []
    for k, kind in enumerate(kinds):
        params += [make(s, k) for s in specs[kind] if s.expert is None or s.expert < local_experts]
    if has_loss:
        for s in specs["final"]:
            if s.name == "output_layer.weight" and counts.tied_embeddings and has_embedding:
                continue  # tied and on the embedding stage: the embedding weight is the output weight
            params.append(make(s, None))
    return params


def chunk_kinds(counts, dims, r: int, v: int) -> tuple:
    """Per decoder layer of PP rank ``r``'s virtual stage ``v``: ``"moe_layer"`` or ``"dense_layer"``."""
    return tuple("moe_layer" if counts.moe_pattern[i] else "dense_layer" for i in dims.stage_layers[r][v])
