"""Activation memory switches (config group ``memory``): validation, and their application to the model.

docs/k2_reference.md "Training system", "Activation memory": FP8-E4M3 storage of MoE up-projection inputs and
SwiGLU inputs, selective recompute (RMSNorm, SwiGLU, MLA up-projection, MoE down-projection) and CPU
offload of what is still saved. Site names and the tensors they cover: ``config/schema.py``
(``MEMORY_FP8_SITES``, ``MEMORY_RECOMPUTE_SITES``, ``MEMORY_OFFLOAD_SITES``).

Data flow: ``cfg.memory`` -> :class:`MemoryOptions` -> (a) :func:`megatron_recompute_fields` into
megatron's ``TransformerConfig`` (``recompute_granularity="selective"``, ``recompute_modules`` with
``layernorm`` / ``mla_up_proj``: megatron's selective recompute, run on the checkpoint class of
``model/recompute.py``), (b) :func:`install` on the built model chunks: each transformer layer's forward
becomes a :class:`k2.model.saved_tensors.SavedTensorScope` (FP8 storage, offload, recompute, the meter), the
modules whose inputs are sites mark them, and the K2 MLPs (``model/mlp.py``) get the options (SwiGLU and
MoE down-projection recompute are ours: megatron has no non-TE SwiGLU recompute and no
down-projection-only recompute).

Router metrics: none of these recomputes re-runs the router (megatron's ``moe`` / ``mlp`` layer recompute
is not used), so ``K2Router.step_tokens_per_expert``, megatron's ``local_tokens_per_expert`` and its
aux-loss tracker see each forward once (tests/unit/model/test_activation_memory.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k2.config.schema import MEMORY_FP8_SITES, MEMORY_OFFLOAD_SITES, MEMORY_RECOMPUTE_SITES
from k2.model.mlp import K2MLP, K2SequentialMLP
from k2.model.recompute import K2TransformerLayer
from k2.model.saved_tensors import Policy, SavedTensorScope, chain_prefetch, mark

_GROUPS = {
    "fp8_store": MEMORY_FP8_SITES,
    "recompute": MEMORY_RECOMPUTE_SITES,
    "offload": MEMORY_OFFLOAD_SITES,
}

# recompute sites that are megatron-core's recompute_modules (same names; run on our checkpoint class,
# model/recompute.py); swiglu and moe_down_proj are ours (model/mlp.py)
MEGATRON_RECOMPUTE = ("layernorm", "mla_up_proj")


@dataclass(frozen=True)
class MemoryOptions:
    """The resolved ``memory`` switches.

    Attributes:
        fp8_store, recompute, offload: site names (validated by :func:`k2.config.validate.check_memory`).
        attribute: mark every site even when it is off, so that a :class:`~k2.model.saved_bytes_meter.SavedBytesMeter`
            can report bytes per site (``k2-bench bench=memory``); training leaves it False.
    """

    fp8_store: frozenset = frozenset()
    recompute: frozenset = frozenset()
    offload: frozenset = frozenset()
    attribute: bool = False

    @classmethod
    def from_config(cls, cfg, attribute: bool = False) -> "MemoryOptions":
        if "memory" not in cfg:  # a config tree without the memory group: all off
            return cls(attribute=attribute)
        m = cfg.memory
        return cls(frozenset(m.fp8_store or ()), frozenset(m.recompute or ()), frozenset(m.offload or ()),
                   attribute)

    def policy(self, site: str):
        """:class:`k2.model.saved_tensors.Policy` of ``site``, or None when the site does nothing."""

        fp8, off = site in self.fp8_store, site in self.offload
        return Policy(site, fp8, off) if (fp8 or off or self.attribute) else None

    def recomputes(self, site: str) -> bool:
        return site in self.recompute

    @property
    def needs_scopes(self) -> bool:
        """Layer scopes (saved-tensor hooks) carry FP8 storage, offload, attribution and every recompute
        (``model/recompute.py``)."""
        return bool(self.fp8_store or self.offload or self.attribute or self.recompute)


def megatron_recompute_fields(options: MemoryOptions) -> dict:
    """megatron ``TransformerConfig`` fields for the recompute sites megatron has: ``layernorm``
    (``input_layernorm`` and ``pre_mlp_layernorm``) and ``mla_up_proj`` (MLA up-projections and RoPE);
    megatron checkpoints them with the checkpoint class of ``model/recompute.py``. Empty dict when both
    are off."""
    modules = [m for m in MEGATRON_RECOMPUTE if options.recomputes(m)]
    if not modules:
        return {}
    return dict(recompute_granularity="selective", recompute_modules=modules)


class _Chain:
    """The last layer scope committed in one transformer block (for the backward prefetch chain)."""

    last = None


def _mark_input(policy):

    def hook(_module, args):
        if args and hasattr(args[0], "untyped_storage"):
            mark(args[0], policy)

    return hook


def _install_layer(layer, first: bool, chain: _Chain, options: MemoryOptions) -> None:

    def pre(mod, _args):
        mod._k2_scope = None
        if not torch.is_grad_enabled():  # evaluation: nothing is saved
            return
        scope = SavedTensorScope(f"layer {mod.layer_number}")
        scope.prev = None if first else chain.last
        chain.last = None
        scope.__enter__()
        mod._k2_scope = scope

    def post(mod, _args, output):
        scope, mod._k2_scope = mod._k2_scope, None
        if scope is None:
            return
        scope.__exit__(None, None, None)
        out = output[0] if isinstance(output, (tuple, list)) else output
        chain_prefetch(out, scope)
        chain.last = scope

    layer.register_forward_pre_hook(pre)
    layer.register_forward_hook(post, always_call=True)

    # sites marked by their module's input (see config/schema.py MEMORY_OFFLOAD_SITES)
    sites = {"attn_input": [layer.input_layernorm], "mlp_input": [layer.pre_mlp_layernorm]}
    attn = layer.self_attention
    sites["mla_up_proj"] = [getattr(attn, n) for n in ("linear_q_down_proj", "linear_kv_down_proj", "q_layernorm",
                                                       "kv_layernorm", "linear_q_up_proj", "linear_kv_up_proj",
                                                       "linear_q_proj")
                            if isinstance(getattr(attn, n, None), torch.nn.Module)]
    sites["attn_proj"] = [attn.linear_proj]
    for site, modules in sites.items():
        policy = options.policy(site)
        if policy is not None:
            for m in modules:
                m.register_forward_pre_hook(_mark_input(policy))
    # core attention: everything saved inside it (q, k, v, softmax probabilities)
    policy = options.policy("core_attn")
    if policy is not None:
        from k2.model.saved_tensors import current_scope

        def enter(_m, _a):
            scope = current_scope()
            if scope is not None:
                scope.push_region(policy)
            attn._k2_region_scope = scope

        def leave(_m, _a, _o):
            scope, attn._k2_region_scope = getattr(attn, "_k2_region_scope", None), None
            if scope is not None:
                scope.pop_region()

        attn.core_attention.register_forward_pre_hook(enter)
        attn.core_attention.register_forward_hook(leave, always_call=True)


def set_layer_recompute(chunks: list, on: bool) -> int:
    """Switch whole-layer recompute (``memory.recompute`` site ``layer``, ``model/recompute.py``) on every
    transformer layer of ``chunks`` (read by each training forward: a switch between steps needs no
    rebuild). Returns the number of layers set."""
    n = 0
    for chunk in chunks:
        for mod in chunk.modules():
            if isinstance(mod, K2TransformerLayer):
                mod.recompute_whole_layer = bool(on)
                n += 1
    return n


def install(chunks: list, options: MemoryOptions) -> int:
    """Apply ``options`` to built model chunks (before DDP wrapping or after: modules are the same).

    Sets the options on the K2 MLPs (``model/mlp.py``: SwiGLU / MoE down-projection recompute, FP8 and
    offload sites of the MLPs) and, when any switch or attribution is on, makes each transformer layer's
    forward a :class:`k2.model.saved_tensors.SavedTensorScope` (chained for the offload prefetch) and marks
    the input sites. Where megatron recomputes (``layernorm``, ``mla_up_proj``) is set by
    :func:`megatron_recompute_fields` in the ``TransformerConfig``.

    Returns:
        number of transformer layers given a saved-tensor scope.
    """
    from megatron.core.transformer.transformer_block import TransformerBlock


    n = 0
    for chunk in chunks:
        for mod in chunk.modules():
            if isinstance(mod, (K2MLP, K2SequentialMLP)):
                mod.memory = options
    set_layer_recompute(chunks, options.recomputes("layer"))  # whole-layer recompute (model/recompute.py)
    for chunk in chunks:
        if not options.needs_scopes:
            continue
        for block in [m for m in chunk.modules() if isinstance(m, TransformerBlock)]:
            chain = _Chain()
            for i, layer in enumerate(block.layers):
                _install_layer(layer, i == 0, chain, options)
                n += 1
    return n
