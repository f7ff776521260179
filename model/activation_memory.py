"""Activation memory switches (config group ``memory``): validation, and their application to the model.

docs/k2_reference.md "Training system", "Activation memory": FP8-E4M3 storage of MoE up-projection inputs and
SwiGLU inputs, selective recompute (RMSNorm, SwiGLU, MLA up-projection, MoE down-projection) and CPU
offload of what is still saved. Site names and the tensors they cover: ``config/schema.py``
(``MEMORY_FP8_SITES``, ``MEMORY_RECOMPUTE_SITES``, ``MEMORY_OFFLOAD_SITES``).

Data flow: ``cfg.memory`` -> :class:`MemoryOptions` -> (a) :func:`megatron_recompute_fields` into
megatron's ``TransformerConfig`` (``recompute_granularity="selective"``, ``recompute_modules`` with
``layernorm`` / ``mla_up_proj``: megatron's selective recompute, run on the checkpoint class of
``model/recompute.py``), (b) :func:`install` on the built model chunks: each transformer layer's forward
becomes a :class:`k2.model.saved_tensors.SavedTensorScope` (FP8 storage, offload, recompute, the meter) and
the modules whose inputs are sites mark them, then (c) :func:`set_memory_options` gives every layer and
K2 MLP (``model/mlp.py``) the options (SwiGLU and MoE down-projection recompute are ours: megatron has no
non-TE SwiGLU recompute and no down-projection-only recompute).

Switching between steps (a schedule phase's ``memory.*``, ``k2-train``): every switch is read per forward
-- the hooks take their site policies from the layer's ``memory`` attribute when they run, the MLPs read
theirs, and megatron decides where it recomputes from per-module attributes that its ``__init__`` derives
from the ``TransformerConfig`` once (``TransformerLayer.recompute_input_layernorm`` /
``recompute_pre_mlp_layernorm``, ``MLASelfAttention.recompute_up_proj``; after ``__init__``,
megatron-core 0.19.2 reads ``recompute_granularity`` / ``recompute_modules`` on this model's path only in
``TransformerBlock.forward``'s ``== "full"``, which we never set, and its other ``__init__`` reads are of
recompute modules we never set: ``core_attn``, ``mlp``, ``moe``, ``moe_act``, ``shared_experts``) -- so
:func:`set_memory_options` on built chunks switches everything, and a model built with one phase's
options and switched computes and saves exactly what one built with the other's would (bitwise,
tests/unit/launcher/training/test_phase_memory.py). Only the scopes themselves are installed at build time:
:func:`install` installs them when any of the options the run will use needs them.

Router metrics: none of these recomputes re-runs the router (megatron's ``moe`` / ``mlp`` layer recompute
is not used), so ``K2Router.step_tokens_per_expert``, megatron's ``local_tokens_per_expert`` and its
aux-loss tracker see each forward once (tests/unit/model/test_activation_memory.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from k2.config.schema import MEMORY_FP8_SITES, MEMORY_OFFLOAD_SITES, MEMORY_RECOMPUTE_SITES
from k2.model.mlp import K2MLP, K2SequentialMLP
from k2.model.recompute import K2TransformerLayer
from k2.model.saved_tensors import Policy, SavedTensorScope, chain_prefetch, current_scope, mark

if TYPE_CHECKING:
    from k2.config.schema import K2Config

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
    def from_config(cls, cfg: K2Config, attribute: bool = False) -> MemoryOptions:
        if "memory" not in cfg:  # a config tree without the memory group: all off
            return cls(attribute=attribute)
        return cls.from_sites(cfg.memory, attribute)

    @classmethod
    def from_sites(cls, sites, attribute: bool = False) -> MemoryOptions:
        """From a mapping of site lists (the ``memory`` group, or a schedule phase's resolved
        ``k2.schedules.wsd.Phase.memory``): keys ``fp8_store`` / ``recompute`` / ``offload``, a missing
        key or None = off."""
        get = sites.get if hasattr(sites, "get") else (lambda k: getattr(sites, k, None))
        return cls(
            frozenset(get("fp8_store") or ()),
            frozenset(get("recompute") or ()),
            frozenset(get("offload") or ()),
            attribute,
        )

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


_OFF = MemoryOptions()


def _options(layer) -> MemoryOptions:
    """The options a layer runs with now (:func:`set_memory_options`)."""
    return layer.memory if layer.memory is not None else _OFF


def _mark_input(layer, site: str):
    # the policy is looked up per call: set_memory_options may change it between steps

    def hook(_module, args):
        if args and hasattr(args[0], "untyped_storage"):
            mark(args[0], _options(layer).policy(site))

    return hook


def open_layer_scope(layer) -> None:
    """Start the saved-tensor scope of one forward of ``layer`` (its forward pre-hook; nothing in
    evaluation, nothing for a layer without a scope)."""
    layer._k2_scope = None
    if not torch.is_grad_enabled() or not getattr(layer, "_k2_scoped", False):
        return
    first, chain = layer._k2_chain
    scope = SavedTensorScope(f"layer {layer.layer_number}")
    scope.prev = None if first else chain.last
    chain.last = None
    scope.__enter__()
    layer._k2_scope = scope


def close_layer_scope(layer, output, suspended: bool = False) -> None:
    """Commit the scope :func:`open_layer_scope` started (its forward hook): offload, meter, and the
    backward prefetch chain on ``output`` (the layer's output, or ``(output, context)``); ``suspended``:
    the scope was left already (:func:`run_layer_part`)."""
    scope, layer._k2_scope = getattr(layer, "_k2_scope", None), None
    if scope is None:
        return
    if suspended:
        scope.commit()
    else:
        scope.__exit__(None, None, None)
    out = output[0] if isinstance(output, (tuple, list)) else output
    chain_prefetch(out, scope)
    layer._k2_chain[1].last = scope


def run_layer_part(layer, fn, first: bool, last: bool):
    """``fn()``, one part of ``layer``'s forward run apart from the others (a node of megatron's
    combined-1F1B schedule, with another microbatch's nodes in between): the first part opens the layer's
    saved-tensor scope, each part runs inside it (on the thread that runs the part), the last commits it,
    so every tensor the layer saves is treated as in one forward call (same sites, same marks).

    Returns:
        ``fn()``.
    """
    if first:
        open_layer_scope(layer)
    scope = getattr(layer, "_k2_scope", None)
    if scope is None:
        return fn()
    if not first:
        scope.resume()
    try:
        out = fn()
    except BaseException:
        scope.suspend()
        layer._k2_scope = None
        raise
    scope.suspend()
    if last:
        close_layer_scope(layer, out, suspended=True)
    return out


def _install_layer(layer, first: bool, chain: _Chain) -> None:
    layer._k2_chain = (first, chain)
    layer.register_forward_pre_hook(lambda mod, _args: open_layer_scope(mod))
    layer.register_forward_hook(lambda mod, _args, output: close_layer_scope(mod, output), always_call=True)

    # sites marked by their module's input (see config/schema.py MEMORY_OFFLOAD_SITES)
    sites = {"attn_input": [layer.input_layernorm], "mlp_input": [layer.pre_mlp_layernorm]}
    attn = layer.self_attention
    sites["mla_up_proj"] = [
        getattr(attn, n)
        for n in (
            "linear_q_down_proj",
            "linear_kv_down_proj",
            "q_layernorm",
            "kv_layernorm",
            "linear_q_up_proj",
            "linear_kv_up_proj",
            "linear_q_proj",
        )
        if isinstance(getattr(attn, n, None), torch.nn.Module)
    ]
    sites["attn_proj"] = [attn.linear_proj]
    for site, modules in sites.items():
        for m in modules:
            m.register_forward_pre_hook(_mark_input(layer, site))

    # core attention: everything saved inside it (q, k, v, softmax probabilities)
    def enter(_m, _a):
        policy = _options(layer).policy("core_attn")
        scope = current_scope() if policy is not None else None
        if scope is not None:
            scope.push_region(policy)
        attn._k2_region_scope = scope

    def leave(_m, _a, _o):
        scope, attn._k2_region_scope = getattr(attn, "_k2_region_scope", None), None
        if scope is not None:
            scope.pop_region()

    attn.core_attention.register_forward_pre_hook(enter)
    attn.core_attention.register_forward_hook(leave, always_call=True)


def _layers(chunks: list):
    for chunk in chunks:
        for mod in chunk.modules():
            if isinstance(mod, K2TransformerLayer):
                yield mod


def set_memory_options(chunks: list, options: MemoryOptions) -> int:
    """Make every transformer layer of ``chunks`` run with ``options`` from its next forward on (between
    steps: a schedule phase boundary; no rebuild, parameters and optimizer untouched).

    Sets, per layer: the options its site hooks read (FP8 storage, offload, attribution; installed by
    :func:`install`), the K2 MLPs' options (``swiglu`` / ``moe_down_proj`` recompute, the MLP sites),
    whole-layer recompute (site ``layer``, ``model/recompute.py``) and megatron's selective recompute
    attributes as megatron's ``__init__`` would set them from a ``TransformerConfig`` with
    :func:`megatron_recompute_fields` of ``options``: ``TransformerLayer.recompute_input_layernorm`` /
    ``recompute_pre_mlp_layernorm`` (``layernorm``; only where the norm is not megatron's ``IdentityOp``;
    megatron's CUDA-graph and FP8-compute conditions there do not apply: this project uses neither) and
    ``MLASelfAttention.recompute_up_proj`` (``mla_up_proj``).

    Without saved-tensor scopes (:func:`install` left them out because no option of the run needed them)
    the sites act as off; switching to options that need scopes then raises.

    Returns:
        number of transformer layers set.

    Raises:
        ValueError: ``options`` need saved-tensor scopes and the layers have none.
    """
    from megatron.core.transformer.identity_op import IdentityOp

    n = 0
    for layer in _layers(chunks):
        if options.needs_scopes and not getattr(layer, "_k2_scoped", False):
            raise ValueError(
                f"layer {layer.layer_number} has no saved-tensor scope for {options}: build the "
                "model with every memory option the run switches to (install(..., switches=...))"
            )
        layer.memory = options
        layer.recompute_whole_layer = options.recomputes("layer")
        norm = options.recomputes("layernorm")
        layer.recompute_input_layernorm = norm and not isinstance(layer.input_layernorm, IdentityOp)
        layer.recompute_pre_mlp_layernorm = norm and not isinstance(layer.pre_mlp_layernorm, IdentityOp)
        layer.self_attention.recompute_up_proj = options.recomputes("mla_up_proj")
        for mod in layer.modules():
            if isinstance(mod, (K2MLP, K2SequentialMLP)):
                mod.memory = options
        n += 1
    return n


def install(chunks: list, options: MemoryOptions, switches=()) -> int:
    """Apply ``options`` to built model chunks (before DDP wrapping or after: modules are the same).

    When ``options`` or any of ``switches`` (the other options the run will set with
    :func:`set_memory_options`, e.g. the schedule phases') needs them, makes each transformer layer's forward
    a :class:`k2.model.saved_tensors.SavedTensorScope` (chained for the offload prefetch) and hooks the
    input sites and core attention (their policies are read per forward); then
    :func:`set_memory_options` ``(chunks, options)``.

    Returns:
        number of transformer layers given a saved-tensor scope.
    """
    from megatron.core.transformer.transformer_block import TransformerBlock

    n = 0
    if any(o.needs_scopes for o in (options, *switches)):
        for chunk in chunks:
            for block in [m for m in chunk.modules() if isinstance(m, TransformerBlock)]:
                chain = _Chain()
                for i, layer in enumerate(block.layers):
                    _install_layer(layer, i == 0, chain)
                    layer._k2_scoped = True
                    n += 1
    set_memory_options(chunks, options)
    return n
