"""Parameter counts of a K2-family model, taken from the megatron-core modules ``k2-train`` builds.

:func:`count_params` builds, on ``torch.device("meta")`` (shapes only, no memory), a *representative*
``GPTModel`` with the exact specs of :mod:`k2.model.build` (``transformer_config`` ->
``decoder_block_spec``: megatron's local MLA ``MLASelfAttention`` with our ``K2CoreAttention``, RMSNorm,
SwiGLU MLP, ``MoELayer`` with ``K2Router``, ``SequentialMLP`` routed experts and the shared expert) that
holds the embedding, the output head, the final norm, **one dense layer** (if the model has any) and
**one MoE layer** (if any), at full width and with *all* routed experts. It reads the parameter shapes
of that model and multiplies the per-layer numbers by the layer counts (``k2.model.first_k_dense_replace``
dense layers, the rest MoE). For Kimi K2 this builds about 1,200 meta modules instead of 1T parameters
and takes well under a second (plus importing megatron).

No process group is created and ``torch.distributed`` is not touched: every megatron module takes a
``pg_collection`` (``megatron/core/process_groups_config.py``), and the one passed here holds
:class:`SingleRankGroup` stand-ins (``size() == 1``, ``rank() == 0``) for every field. megatron reads
group sizes/ranks through ``utils.get_pg_size`` / ``get_pg_rank`` (which answer 1 / 0 while
``torch.distributed`` is not initialised) or ``group.size()`` / ``group.rank()`` directly, so the model is
built as on a single rank with EP = TP = PP = 1, i.e. with every expert. Building needs the project's
CPU backend on a machine without CUDA (megatron's RoPE module calls ``torch.cuda.current_device()``).

What is counted (``nn.Module.parameters()``, element counts; buffers such as the router's
``expert_bias`` and the per-step token counters, and ``K2CoreAttention.max_logits``, are *not*
parameters and are not counted). Components, named after megatron's parameter names:

* ``embedding``: ``embedding.word_embeddings.weight`` ``[vocab, hidden]``.
* ``output_head``: ``output_layer.weight`` ``[vocab, hidden]`` (0 when tied to the embedding).
* ``final_norm``: ``decoder.final_layernorm.weight`` ``[hidden]``.
* ``attention`` (per layer, dense and MoE alike): ``input_layernorm`` + the whole ``self_attention``:
  MLA ``linear_q_down_proj`` ``[q_lora, hidden]``, ``q_layernorm`` ``[q_lora]``, ``linear_q_up_proj``
  ``[heads * (qk + rope), q_lora]``, ``linear_kv_down_proj`` ``[kv_lora + rope, hidden]``,
  ``kv_layernorm`` ``[kv_lora]``, ``linear_kv_up_proj`` ``[heads * (qk + v), kv_lora]``, ``linear_proj``
  ``[hidden, heads * v]``.
* ``mlp_norm`` (per layer): ``pre_mlp_layernorm`` ``[hidden]``.
* ``dense_mlp`` (per dense layer): SwiGLU ``linear_fc1`` ``[2 * ffn, hidden]`` + ``linear_fc2``
  ``[hidden, ffn]``.
* ``router`` (per MoE layer): ``mlp.router.weight`` ``[experts, hidden]``.
* ``routed_experts`` (per MoE layer, all experts): ``mlp.experts.local_experts.*``, each expert
  ``[2 * moe_ffn, hidden]`` + ``[hidden, moe_ffn]``; ``routed_expert`` is one of them.
* ``shared_experts`` (per MoE layer): ``mlp.shared_experts.*``, SwiGLU of
  ``moe_shared_expert_intermediate_size``.

Totals (K2 report convention, docs/k2_reference.md "Model"):

* ``params_total`` = embedding + output head + final norm + every layer (all routed experts).
* ``params_active`` (per token) = embedding + output head + final norm + ``attention`` + ``mlp_norm`` of
  every layer + ``dense_mlp`` of each dense layer + (``router`` + ``shared_experts`` + ``moe_router_topk``
  x ``routed_expert``) of each MoE layer. (The whole embedding matrix counts, as in the "32.6B
  activated" figure.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from k2.model.build import moe_layer_pattern
from k2.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = [
    "COMPONENTS",
    "ModelParams",
    "ParamSpec",
    "SingleRankGroup",
    "count_params",
    "count_module_params",
    "single_rank_pg_collection",
]

#: Component names of :class:`ModelParams` / :func:`classify_param`, in model order.
COMPONENTS = (
    "embedding",
    "attention",
    "mlp_norm",
    "dense_mlp",
    "router",
    "routed_experts",
    "shared_experts",
    "final_norm",
    "output_head",
)
_PER_LAYER = ("attention", "mlp_norm", "dense_mlp", "router", "routed_experts", "shared_experts")

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class SingleRankGroup:
    """Stand-in for a ``torch.distributed.ProcessGroup`` of one rank: ``size() == 1``, ``rank() == 0``.

    Only for *building* modules (shape decisions); a forward pass that communicates would fail.
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "SingleRankGroup()"


def single_rank_pg_collection():
    """A megatron ``ProcessGroupCollection`` whose every group is a :class:`SingleRankGroup`."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    group = SingleRankGroup()
    names = [f.name for f in dataclasses.fields(ProcessGroupCollection)]
    return ProcessGroupCollection(**{n: ([group] if n == "hcp" else group) for n in names})


def classify_param(name: str, moe_layers: Iterable[int] = ()) -> tuple[str, int | None]:
    """Component of a ``GPTModel`` parameter name and its local layer index (None outside layers).

    Args:
        name: e.g. ``decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight``.
        moe_layers: local indices of MoE layers (their ``mlp.*`` is router/experts/shared experts).

    Raises:
        ValueError: a name this module does not know (a spec change must update the counting).
    """
    if name.startswith("embedding."):
        return "embedding", None
    if name.startswith("output_layer."):
        return "output_head", None
    if name.startswith("decoder.final_layernorm."):
        return "final_norm", None
    m = _LAYER_RE.match(name)
    if m:
        i, rest = int(m.group(1)), m.group(2)
        if rest.startswith(("input_layernorm.", "self_attention.")):
            return "attention", i
        if rest.startswith("pre_mlp_layernorm."):
            return "mlp_norm", i
        if rest.startswith("mlp."):
            if i not in set(moe_layers):
                return "dense_mlp", i
            if rest.startswith("mlp.router."):
                return "router", i
            if rest.startswith("mlp.experts."):
                return "routed_experts", i
            if rest.startswith("mlp.shared_experts."):
                return "shared_experts", i
    raise ValueError(f"unclassified parameter {name!r}: update model/params.py for the new layer spec")


def count_module_params(module) -> int:
    """Number of parameter elements of ``module`` (shared tensors once; buffers not counted)."""
    return sum(p.numel() for p in module.parameters())


@dataclass(frozen=True)
class ParamSpec:
    """Name and shape of one parameter of a block of the representative model (for memory layouts).

    Attributes:
        name: the parameter's name inside a ``GPTModel`` with the block at local layer 0, e.g.
            ``embedding.word_embeddings.weight``, ``decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight``,
            ``output_layer.weight``.
        shape: its shape (TP = 1, all experts).
        expert: index of the routed expert it belongs to, or None.
    """

    name: str
    shape: tuple[int, ...]
    expert: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


_EXPERT_RE = re.compile(r"\.local_experts\.(\d+)\.")


def _block_specs(model, moe_local: list[int]) -> dict[str, tuple[ParamSpec, ...]]:
    """Parameters of the representative model in ``named_parameters`` order, per block kind:
    ``embedding``, ``dense_layer``, ``moe_layer`` (all experts) and ``final`` (final norm + output head);
    layer parameter names are renamed to local layer 0."""
    blocks: dict[str, list[ParamSpec]] = {"embedding": [], "dense_layer": [], "moe_layer": [], "final": []}
    for name, p in model.named_parameters():
        m = _LAYER_RE.match(name)
        if m:
            kind = "moe_layer" if int(m.group(1)) in moe_local else "dense_layer"
            local = f"decoder.layers.0.{m.group(2)}"
            e = _EXPERT_RE.search(local)
            blocks[kind].append(ParamSpec(local, tuple(p.shape), int(e.group(1)) if e else None))
        elif name.startswith("embedding."):
            blocks["embedding"].append(ParamSpec(name, tuple(p.shape)))
        else:
            blocks["final"].append(ParamSpec(name, tuple(p.shape)))
    return {k: tuple(v) for k, v in blocks.items()}


#: the parameters megatron's tensor parallelism splits over the TP ranks (a name containing one of these):
#: MLA's up-projections and output projection (the q projection without a q latent), the dense and the
#: shared-expert MLPs, the embedding and the output head (vocabulary-parallel). Whole on every TP rank: the
#: norms, the router, MLA's down-projections (Transformer Engine's ``duplicated`` linears) and the routed
#: experts (expert TP 1: :mod:`k2.launcher.planning.tp_layout`).
TP_SHARDED = (
    "self_attention.linear_q_up_proj.",
    "self_attention.linear_kv_up_proj.",
    "self_attention.linear_q_proj.",
    "self_attention.linear_proj.",
    "mlp.linear_fc1.",
    "mlp.linear_fc2.",
    "mlp.shared_experts.linear_fc1.",
    "mlp.shared_experts.linear_fc2.",
    "embedding.word_embeddings.",
    "output_layer.",
)


def tp_sharded(name: str) -> bool:
    """A parameter (by its name in the model) that megatron's TP splits over the TP ranks (:data:`TP_SHARDED`)."""
    return any(x in name for x in TP_SHARDED)


@dataclass(frozen=True)
class ModelParams:
    """Parameter counts (elements) of one K2-family model, per component; see the module docstring.

    Per-layer fields are for ONE layer of that kind; ``routed_experts`` is all experts of one MoE
    layer and ``routed_expert`` one expert.
    """

    embedding: int
    output_head: int
    final_norm: int
    attention: int
    mlp_norm: int
    dense_mlp: int
    router: int
    routed_experts: int
    routed_expert: int
    shared_experts: int
    num_layers: int
    moe_pattern: tuple[int, ...]  # per global layer: 0 dense, 1 MoE (megatron moe_layer_freq)
    num_experts: int
    topk: int
    tied_embeddings: bool
    #: parameter names/shapes per block kind (see :class:`ParamSpec`), for megatron's buffer layouts
    specs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def num_dense_layers(self) -> int:
        return self.moe_pattern.count(0)

    @property
    def num_moe_layers(self) -> int:
        return self.moe_pattern.count(1)

    @property
    def dense_layer(self) -> int:
        """All parameters of one dense layer."""
        return self.attention + self.mlp_norm + self.dense_mlp

    @property
    def moe_layer(self) -> int:
        """All parameters of one MoE layer (every routed expert)."""
        return self.attention + self.mlp_norm + self.router + self.routed_experts + self.shared_experts

    @property
    def moe_layer_active(self) -> int:
        """Parameters one token touches in one MoE layer: top-k routed experts."""
        return self.attention + self.mlp_norm + self.router + self.shared_experts + (self.topk * self.routed_expert)

    def layer(self, i: int) -> int:
        """Parameters of global 0-based layer ``i``."""
        return self.moe_layer if self.moe_pattern[i] else self.dense_layer

    def layer_active(self, i: int) -> int:
        """Parameters a token touches in global 0-based layer ``i``."""
        return self.moe_layer_active if self.moe_pattern[i] else self.dense_layer

    @property
    def total(self) -> int:
        """params_total: the whole model, every expert, embedding and head (once if tied)."""
        return self.embedding + self.output_head + self.final_norm + sum(self.layer(i) for i in range(self.num_layers))

    @property
    def active(self) -> int:
        """params_active per token (see the module docstring)."""
        return (
            self.embedding
            + self.output_head
            + self.final_norm
            + sum(self.layer_active(i) for i in range(self.num_layers))
        )

    def stage(self, layers: Iterable[int], has_embedding: bool, has_loss: bool, ep: int = 1, tp: int = 1) -> int:
        """Parameters held by one pipeline stage (virtual stage or a PP rank's chunks together).

        Args:
            layers: global 0-based layer indices of the stage.
            has_embedding: the stage owns the input embedding.
            has_loss: the stage owns final norm + output head.
            ep: expert-parallel size; routed experts are divided over it (``ep=1``: the stage over its
                whole EP group; ``ep=parallel.ep``: what one GPU holds).
            tp: tensor-parallel size; the parameters of :data:`TP_SHARDED` are divided over it (``tp=1``:
                the whole stage; ``tp=parallel.tp``: what one GPU holds).

        With tied embeddings megatron keeps a copy of the embedding as output weight on the loss stage
        when that is not the embedding stage; the copy is counted here (it is memory), not in ``total``.
        """
        if self.num_experts and self.num_experts % ep:
            raise ValueError(f"ep={ep} does not divide num_experts={self.num_experts}")
        sharded = self._tp_sharded
        cut = 1 - 1 / tp  # (of a TP-sharded parameter one GPU holds 1 / tp)
        n = 0.0
        for i in layers:
            if self.moe_pattern[i]:
                n += self.moe_layer - self.routed_experts + self.routed_experts // ep - cut * sharded["moe_layer"]
            else:
                n += self.dense_layer - cut * sharded["dense_layer"]
        if has_embedding:
            n += self.embedding - cut * sharded["embedding"]
        if has_loss:
            n += self.final_norm + self.output_head - cut * sharded["final"]
            if self.tied_embeddings and not has_embedding:
                n += self.embedding - cut * sharded["embedding"]
        return int(round(n))

    @functools.cached_property
    def _tp_sharded(self) -> dict[str, int]:
        """Per block kind the elements of its TP-sharded parameters (:func:`tp_sharded`; the routed experts
        are not: expert TP 1). Computed once: :meth:`stage` runs per stage of every layout a search tries."""
        return {
            kind: sum(sp.numel for sp in self.specs.get(kind, ()) if tp_sharded(sp.name))
            for kind in ("embedding", "dense_layer", "moe_layer", "final")
        }

    def as_dict(self) -> dict[str, Any]:
        """Per-component counts, derived per-layer numbers and totals, for JSON output."""
        return {
            "embedding": self.embedding,
            "output_head": self.output_head,
            "final_norm": self.final_norm,
            "attention_per_layer": self.attention,
            "mlp_norm_per_layer": self.mlp_norm,
            "dense_mlp_per_layer": self.dense_mlp,
            "router_per_moe_layer": self.router,
            "routed_experts_per_moe_layer": self.routed_experts,
            "routed_expert_each": self.routed_expert,
            "shared_experts_per_moe_layer": self.shared_experts,
            "dense_layer": self.dense_layer,
            "moe_layer": self.moe_layer,
            "moe_layer_active": self.moe_layer_active,
            "num_layers": self.num_layers,
            "num_dense_layers": self.num_dense_layers,
            "num_moe_layers": self.num_moe_layers,
            "num_experts": self.num_experts,
            "moe_router_topk": self.topk,
            "tied_embeddings": self.tied_embeddings,
            "params_total": self.total,
            "params_active": self.active,
        }


def _reduced_config(cfg: K2Config, num_layers: int, first_k_dense: int):
    """``cfg`` with ``k2.model.num_layers`` / ``first_k_dense_replace`` replaced, the single layout and the
    GEMMs in the training precision (FP8 GEMMs, ``train.fp8_recipe``, hold the same parameters; megatron
    builds their config only with Transformer Engine)."""
    from omegaconf import OmegaConf

    c = OmegaConf.to_container(cfg, resolve=True)
    c["model"]["num_layers"] = num_layers
    c["model"]["first_k_dense_replace"] = first_k_dense
    c["parallel"].update(tp=1, pp=1, vpp=None, ep=1, layout=None, first_stage_layers=None, last_stage_layers=None)
    c["train"]["fp8_recipe"] = None
    return OmegaConf.create(c)


@contextlib.contextmanager
def _quiet():
    """Keep megatron's import/build chatter (warnings, deprecation logs, prints) off stdout."""
    mlog = logging.getLogger("megatron")
    level = mlog.level
    mlog.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        mlog.setLevel(level)


def build_representative_model(cfg: K2Config):
    """The meta-device ``GPTModel`` of :func:`count_params` and its local MoE-layer indices.

    Args:
        cfg: composed config (``model``, ``train`` sections used; ``parallel`` is ignored).

    Returns:
        ``(model, moe_local_layers)``: local layer 0 is dense when the model has dense layers, the next
        (or only) layer is MoE when it has MoE layers.
    """
    import torch

    with _quiet():  # importing megatron warns about the missing Transformer Engine / Apex
        from k2.model.build import decoder_block_spec, moe_layer_pattern, transformer_config
        from k2.parallel import cpu_backend

    pattern = moe_layer_pattern(cfg.model)  # validates first_k_dense_replace
    has_dense, has_moe = 0 in pattern, 1 in pattern
    n = int(has_dense) + int(has_moe)
    small = _reduced_config(cfg, n, 1 if has_dense else 0)  # [dense?, moe?]
    dims = ParallelDims.from_config(small.parallel, small.model, 1)
    with _quiet():
        cpu_backend.enable()  # no-op with CUDA; megatron's RoPE asks torch.cuda for a device
        from megatron.core.models.gpt.gpt_model import GPTModel

        tcfg = transformer_config(small, dims)
        tcfg.perform_initialization = False  # shapes only
        tcfg.use_cpu_initialization = True  # no explicit device: tensors follow the meta device
        spec = decoder_block_spec(tcfg, None, 0, bool(small.model.record_max_logits))
        with torch.device("meta"):
            model = GPTModel(
                config=tcfg,
                transformer_layer_spec=spec,
                vocab_size=small.model.vocab_size,
                max_sequence_length=small.model.max_position_embeddings,
                pre_process=True,
                post_process=True,
                share_embeddings_and_output_weights=small.model.share_embeddings_and_output_weights,
                position_embedding_type="none",
                pg_collection=single_rank_pg_collection(),
            )
    moe_local = [i for i, kind in enumerate(moe_layer_pattern(small.model)) if kind]
    return model, moe_local


def count_params(cfg: K2Config) -> ModelParams:
    """Per-component parameter counts of ``cfg.model`` from megatron modules built on the meta device.

    Args:
        cfg: composed config (:func:`k2.config.load_config`).

    Returns:
        :class:`ModelParams`.

    Raises:
        ValueError: ``k2.model.first_k_dense_replace`` out of range, or a parameter whose name the
            classification does not know.
    """
    model, moe_local = build_representative_model(cfg)
    sums = {c: 0 for c in COMPONENTS}
    per_layer: dict[tuple[str, int], int] = {}
    expert0 = 0
    for name, p in model.named_parameters():
        comp, layer = classify_param(name, moe_local)
        if layer is None:
            sums[comp] += p.numel()
        else:
            per_layer[(comp, layer)] = per_layer.get((comp, layer), 0) + p.numel()
            if comp == "routed_experts" and ".local_experts.0." in name:
                expert0 += p.numel()
    for (comp, _), v in per_layer.items():  # the representative layers hold one of each kind
        sums[comp] = v
    m = cfg.model
    num_experts = int(m.num_moe_experts or 0)
    if num_experts and sums["routed_experts"] != expert0 * num_experts:
        raise ValueError(
            f"routed experts are not all the same size ({sums['routed_experts']} != {num_experts} x {expert0})"
        )

    return ModelParams(
        embedding=sums["embedding"],
        output_head=sums["output_head"],
        final_norm=sums["final_norm"],
        attention=sums["attention"],
        mlp_norm=sums["mlp_norm"],
        dense_mlp=sums["dense_mlp"],
        router=sums["router"],
        routed_experts=sums["routed_experts"],
        routed_expert=expert0,
        shared_experts=sums["shared_experts"],
        num_layers=int(m.num_layers),
        moe_pattern=tuple(moe_layer_pattern(m)),
        num_experts=num_experts,
        topk=int(m.moe_router_topk) if num_experts else 0,
        tied_embeddings=bool(m.share_embeddings_and_output_weights),
        specs=_block_specs(model, moe_local),
    )


if __name__ == "__main__":  # quick look: python -m model.params model=kimi_k2
    from k2.config.load import load_config

    print(count_params(load_config(sys.argv[1:])).as_dict())
