"""Which parameter goes to which optimizer under MuonClip, and which matrices Muon sees in each.

K2 rule (docs/k2_reference.md "Optimizer"; K2 report section 2.1; Moonshot's reference code, Moonlight
``examples/toy_train.py``: every parameter with ndim >= 2 except the token embedding and the output head):
Muon for every weight matrix of the transformer -- attention projections (MLA: ``linear_q_down_proj``,
``linear_q_up_proj``, ``linear_kv_down_proj``, ``linear_kv_up_proj``, ``linear_proj``, each one matrix),
dense and expert MLPs, shared experts, the MoE router weight (``optim.router_optimizer``, default
``muon``) -- with each expert's matrices and the SwiGLU gate and up projections orthogonalised
separately; AdamW for the token embedding, the output head, norms, biases and any other non-matrix
tensor. The MoE expert bias is a buffer, updated by megatron's aux-loss-free balancing rule, in no
optimizer.

Weight decay (``optim.decay_all_params``, true in the muonclip recipe, false in the adamw baseline):
Moonlight decays every parameter, and "Muon is Scalable" (arXiv 2502.16982, appendix D) calls decaying the
RMSNorm gamma important for stability; false gives megatron's default (no decay for 1-D tensors and biases, its
``get_standard_config_overrides``). :func:`weight_decayed` is the rule; :func:`k2.optim.build.build_optimizer`
gives megatron the matching param-group overrides.

:func:`tag_parameters` writes the decision onto each parameter (before megatron's DDP builds its buffers:
the ZeRO-1 layout depends on it) and returns one :class:`ParamRoute` per parameter;
:func:`route_table` turns the routes of all ranks into the table the trainer logs at start.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from k2.model.build import global_param_name
from k2.optim.muon import SPLIT_ATTR, MatrixSplit

if TYPE_CHECKING:
    from k2.config.schema import OptimConfig

#: Parameter attribute: ``"muon"`` or ``"adamw"``.
ROUTE_ATTR = "k2_optimizer"
#: megatron-core's buffer key (``BufferKey.is_managed_by_layer_wise_optimizer``): True puts a parameter into
#: DDP buffers apart from the others; under ZeRO-1 the Muon matrices go there, owned by the Muon
#: optimizer (byte-range :mod:`k2.optim.distributed_muon` or megatron's layer-wise one).
LAYER_WISE_ATTR = "is_managed_by_layer_wise_optimizer"


@dataclass(frozen=True)
class ParamRoute:
    """One parameter's optimizer.

    Attributes:
        name: layout-independent global name (``k2.model.build.global_param_name``).
        shape: stored shape.
        optimizer: ``"muon"`` or ``"adamw"``.
        rule: why (``"matrix"``, ``"embedding"``, ``"output head"``, ``"router"``, ``"norm/bias/1-D"``...).
        matrices: the matrices Muon orthogonalises, e.g. ``"gate [64, 128] + up [64, 128]"``; ``"-"``
            for AdamW.
        weight_decay: whether decoupled weight decay applies (:func:`weight_decayed`).
    """

    name: str
    shape: tuple[int, ...]
    optimizer: str
    rule: str
    matrices: str
    weight_decay: bool


def _split_for(name: str, p: torch.Tensor, tcfg) -> tuple[MatrixSplit | None, list[str]]:
    """The :class:`MatrixSplit` of a stored 2-D weight and the names of its matrices."""
    if name.endswith("linear_fc1.weight") and tcfg.gated_linear_unit:
        half = p.shape[0] // 2
        return MatrixSplit(1, (half, half)), ["gate", "up"]
    if name.endswith("linear_qkv.weight"):
        heads = tcfg.num_attention_heads
        groups = tcfg.num_query_groups or heads
        d = tcfg.kv_channels
        if p.shape[0] != groups * (heads // groups + 2) * d:
            raise ValueError(f"{name}: shape {tuple(p.shape)} does not fit {groups} query groups")
        return MatrixSplit(groups, (heads // groups * d, d, d)), ["q", "k", "v"]
    return None, []


def weight_decayed(name: str, p, decay_all_params: bool = True) -> bool:
    """Whether decoupled weight decay applies to parameter ``name``.

    ``decay_all_params`` (``optim.decay_all_params``; Moonlight ``examples/toy_train.py``, "Muon is
    Scalable" appendix D): every parameter. Otherwise megatron-core's default rule
    (``get_standard_config_overrides``): not on 1-D tensors (norm weights) and biases.
    """
    return decay_all_params or not (p.dim() == 1 or name.endswith(".bias"))


def param_rules(optim_cfg: OptimConfig) -> dict:
    """The ``optim`` section's parameter rules as keyword arguments of :func:`tag_parameters`:
    ``{"router_optimizer": ..., "decay_all_params": ...}``."""
    return {"router_optimizer": optim_cfg.router_optimizer, "decay_all_params": bool(optim_cfg.decay_all_params)}


def route(name: str, p: torch.Tensor, tcfg, router_optimizer: str = "muon") -> tuple[str, str, MatrixSplit | None, str]:
    """K2 optimizer of one parameter.

    Args:
        name: parameter name (local or global; only the suffix matters).
        p: the parameter (its shape and megatron's ``is_embedding_or_output_parameter`` flag).
        tcfg: megatron ``TransformerConfig`` (``gated_linear_unit``, heads, query groups, kv_channels).
        router_optimizer: ``optim.router_optimizer``: ``"muon"`` (Moonlight's rule: the router weight
            ``[experts, hidden]`` is one matrix) or ``"adamw"``.

    Returns:
        ``(optimizer, rule, split, matrices)``: ``optimizer`` is ``"muon"`` or ``"adamw"``; ``split`` the
        :class:`MatrixSplit` for a fused 2-D weight, else None; ``matrices`` a readable description.
    """
    if name.endswith("word_embeddings.weight"):
        return "adamw", "embedding", None, "-"
    if name.endswith("output_layer.weight") or getattr(p, "is_embedding_or_output_parameter", False):
        return "adamw", "output head", None, "-"
    if ".router." in name and router_optimizer != "muon":
        return "adamw", "router", None, "-"
    if p.dim() <= 1 or name.endswith(".bias"):
        return "adamw", "norm/bias/1-D", None, "-"
    if p.dim() == 2:
        split, parts = _split_for(name, p, tcfg)
        if split is None:
            rule = "router" if ".router." in name else "matrix"
            return "muon", rule, None, f"[{p.shape[0]}, {p.shape[1]}]"
        desc = " + ".join(f"{n} [{split.groups * s}, {p.shape[1]}]" for n, s in zip(parts, split.sizes))
        return "muon", "fused matrices", split, desc
    if p.dim() == 3:
        return "muon", "stacked experts", None, f"{p.shape[0]} x [{p.shape[1]}, {p.shape[2]}]"
    return "adamw", f"{p.dim()}-D tensor", None, "-"


def _global_names(chunk, tcfg) -> dict[int, str]:
    """id(param) -> layout-independent global name, for one (unwrapped) GPTModel chunk."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank() if tcfg.num_moe_experts else 0
    per_rank = (tcfg.num_moe_experts or 0) // max(1, tcfg.expert_model_parallel_size)
    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
    layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    return {id(p): global_param_name(n, layer_numbers, ep_rank * per_rank) for n, p in chunk.named_parameters()}


def tag_parameters(
    chunks: list,
    tcfg,
    muon: bool,
    zero1_muon: bool,
    *,
    router_optimizer: str = "muon",
    decay_all_params: bool = True,
    default_route: str = "adamw",
) -> list[ParamRoute]:
    """Decide and record every trainable parameter's optimizer (call before megatron's DDP wrap).

    Sets on each parameter: :data:`ROUTE_ATTR` (``"muon"``/``"adamw"``; all ``default_route`` when ``muon``
    is False), :data:`k2.optim.muon.SPLIT_ATTR` for fused weights, and megatron's :data:`LAYER_WISE_ATTR`
    (True for Muon parameters when ``zero1_muon``: they go into DDP buffers of their own).

    Args:
        chunks: this rank's unwrapped model chunks (``GPTModel``).
        tcfg: megatron ``TransformerConfig``.
        muon: optimizer is MuonClip.
        zero1_muon: the Muon matrices are sharded by ZeRO-1 (:attr:`k2.optim.registry.Placement.zero1_muon`).
        router_optimizer: ``optim.router_optimizer`` (:func:`route`).
        decay_all_params: ``optim.decay_all_params`` (:func:`weight_decayed`; shown in the table only:
            :func:`k2.optim.build.build_optimizer` applies it).
        default_route: the route of every parameter when ``muon`` is False: the optimizer's own update
            (:attr:`k2.optim.registry.OptimizerSpec.default`; AdamW's ``"adamw"``).

    Returns:
        this rank's routes, in parameter order.
    """
    routes = []
    for chunk in chunks:
        names = _global_names(chunk, tcfg)
        for local, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            opt, rule, split, matrices = route(local, p, tcfg, router_optimizer)
            if not muon:
                opt, rule, split, matrices = default_route, f"optim={default_route}", None, "-"
            setattr(p, ROUTE_ATTR, opt)
            if split is not None:
                setattr(p, SPLIT_ATTR, split)
            elif hasattr(p, SPLIT_ATTR):
                delattr(p, SPLIT_ATTR)
            if zero1_muon:
                setattr(p, LAYER_WISE_ATTR, opt == "muon")
            wd = weight_decayed(local, p, decay_all_params)
            routes.append(ParamRoute(names[id(p)], tuple(p.shape), opt, rule, matrices, wd))
    return routes


def _pattern(name: str) -> str:
    name = re.sub(r"\.layers\.\d+\.", ".layers.*.", name)
    return re.sub(r"\.global_experts\.\d+\.", ".global_experts.*.", name)


def route_table(routes: Iterable[ParamRoute]) -> list[dict]:
    """Rows of the optimizer table: routes grouped by name pattern (layer and expert index -> ``*``).

    Args:
        routes: the routes of *all* ranks (duplicates -- the same global name on several DP ranks -- are
            counted once).

    Returns:
        ``[{"params": pattern, "count": n, "shape": [...], "optimizer": ..., "rule": ..., "matrices":
        ..., "weight_decay": bool}]`` sorted by pattern.
    """
    unique = OrderedDict((r.name, r) for r in routes)
    rows: dict[tuple, dict] = {}
    for r in unique.values():
        key = (_pattern(r.name), r.shape, r.optimizer, r.matrices)
        row = rows.setdefault(
            key,
            {
                "params": key[0],
                "count": 0,
                "shape": list(r.shape),
                "optimizer": r.optimizer,
                "rule": r.rule,
                "matrices": r.matrices,
                "weight_decay": r.weight_decay,
            },
        )
        row["count"] += 1
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1]))]


def format_route_table(rows: list[dict]) -> str:
    """The optimizer table as text (one line per row, plus element totals per optimizer)."""
    head = ("params", "count", "shape", "optimizer", "matrices orthogonalised", "wd")
    body = [
        (
            r["params"],
            str(r["count"]),
            "x".join(map(str, r["shape"])),
            r["optimizer"],
            r["matrices"],
            "yes" if r["weight_decay"] else "no",
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    line = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()  # noqa: E731
    totals: dict[str, int] = {}
    for r in rows:
        n = r["count"]
        for s in r["shape"]:
            n *= s
        totals[r["optimizer"]] = totals.get(r["optimizer"], 0) + n
    foot = "elements: " + ", ".join(f"{k} {v:,}" for k, v in sorted(totals.items()))
    return "\n".join([line(head), *(line(b) for b in body), foot])
