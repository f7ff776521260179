"""Build the optimizer of a run: AdamW (``optim=adamw``) or MuonClip (``optim=muonclip``) under ZeRO-1.

Both are megatron-core's optimizers:

* ``adamw``: megatron's Adam with decoupled weight decay (which parameters: ``optim.decay_all_params``,
  :mod:`k2.optim.params`); with ``k2.parallel.use_distributed_optimizer``
  its ``DistributedOptimizer`` (ZeRO-1: fp32 master weights and moments sharded over DP by byte ranges).
* ``muonclip``: :class:`k2.optim.muon.K2Muon` registered in megatron's emerging-optimizer registry as
  :data:`K2_MUON`, for the parameters :mod:`k2.optim.params` routes to Muon, megatron's Adam for the rest.
  With ``k2.parallel.use_distributed_optimizer`` the Muon matrices sit in DDP buffers of their own and
  ZeRO-1 shards them one of two ways (``optim.muon_zero1``); either way every rank applies the update a
  single rank would apply to the full DP-averaged gradient, and the Adam parameters keep megatron's
  byte-range ``DistributedOptimizer``:

  - ``byte_range`` (default; Distributed Muon, "Muon is Scalable" section 2.3): megatron's standard
    byte-range ``DistributedOptimizer`` layout, unpadded, running :mod:`k2.optim.distributed_muon` (a matrix
    that a shard boundary cuts is gathered, orthogonalised whole, and each owner keeps its slice), built
    by megatron's own per-(dense, expert) loop with the Muon/AdamW split (:func:`_byte_range_muonclip`).
  - ``layer_wise``: megatron's *layer-wise* distributed optimizer: DDP gets a layout
    (``LayerWiseDistributedOptimizer.compute_full_param_layout``, see
    :func:`k2.parallel.distributed.wrap_model`) that bin-packs whole parameters into padded DP shards,
    the owner of a matrix runs its Muon step, and the updated weights are all-gathered. It costs up to
    2x the parameter + gradient bytes (K2's PP rank 0) and cannot resume at another DP size.

What megatron-core 0.19.2 gets wrong for K2 and how it is handled here (each checked by a test):

* ``LayerWiseDistributedOptimizer`` wraps its optimizers in megatron's mixed-precision wrapper only when
  ``OptimizerConfig.bf16``; with fp32 parameters it chains raw torch optimizers (no ``main_grad`` ->
  ``grad`` copy; ``ChainedOptimizer`` rejects them). The wrapper (``Float16OptimizerWithFloat16Params``)
  handles fp32 parameters as their own master copy, so the layer-wise path always asks for it
  (``bf16=True`` in the *optimizer* config; the model's precision is unchanged).
* Its Muon routes every 2-D non-embedding weight to Muon (the router too, as K2 does), orthogonalises the fused
  SwiGLU ``linear_fc1`` as one matrix, normalises with eps 1e-7, and its fused-QKV split flag is not
  copied to the fp32 master copies: :mod:`k2.optim.muon` / :mod:`k2.optim.params` replace those rules, and
  :func:`build_optimizer` copies the split onto the master copies.
* ``qk_clip.clip_qk`` assumes Transformer Engine's max logits and the ``DDP -> Float16Module ->
  GPTModel`` nesting, and its MLA rule takes ``sqrt`` of ``tau / S`` for negative ``S`` (NaN):
  :mod:`k2.optim.qk_clip` is ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k2.config.schema import optimizer_settings
from k2.optim.muon import SPLIT_ATTR, K2Muon, newton_schulz_gemms
from k2.optim.params import LAYER_WISE_ATTR, ROUTE_ATTR
from k2.optim.registry import ADAMW_UPDATE, MUON_UPDATE, MatrixStep, OptimizerSpec, optimizer_spec
from k2.schedules.lr import optimizer_lr_settings

if TYPE_CHECKING:
    from k2.config.schema import OptimConfig

#: Name of :class:`k2.optim.muon.K2Muon` in megatron's emerging-optimizer registry.
K2_MUON = "k2_muon"


def leaf_optimizers(optimizer):
    """The optimizers inside megatron's (possibly nested) ``ChainedOptimizer``, in order; none for
    ``None``. (MuonClip: the layer-wise optimizer's Muon and Adam wrappers and the Adam
    ``DistributedOptimizer``.)"""
    if optimizer is None:
        return
    children = getattr(optimizer, "chained_optimizers", None)
    if children is None:
        yield optimizer
        return
    for child in children:
        yield from leaf_optimizers(child)


def _register_k2_muon() -> None:
    """Add :class:`k2.optim.muon.K2Muon` to megatron's emerging-optimizer registry (its documented extension
    point), with the K2 routing: every parameter :mod:`k2.optim.params` did not tag ``"muon"`` -> Adam."""
    from megatron.core.optimizer import emerging_optimizers as eo
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

    if K2_MUON in eo._EMERGING_OPTIMIZERS:
        return

    not_muon = ParamPredicate(name="k2_adamw", fn=lambda p: getattr(p, ROUTE_ATTR, "adamw") != "muon")
    eo._EMERGING_OPTIMIZERS[K2_MUON] = eo.EmergingOptimizerEntry(
        optimizer_cls=K2Muon,
        config_to_kwargs=lambda config, model_chunks, pg_collection: _muon_kwargs(config),
        default_param_overrides={ParamKey(predicate=not_muon): {"optimizer": "adam"}},
    )


def _copy_splits_to_master_params(model: list) -> int:
    """Copy each Muon weight's :class:`k2.optim.muon.MatrixSplit` onto the fp32 master copy megatron's
    mixed-precision wrapper made of it (the copy is what K2Muon steps). Returns how many were copied."""

    n = 0
    for chunk in model:
        for p in chunk.parameters():
            split = getattr(p, SPLIT_ATTR, None)
            main = getattr(p, "main_param", None)
            if split is not None and main is not None and main is not p and main.shape == p.shape:
                setattr(main, SPLIT_ATTR, split)
                n += 1
    return n


def use_torch_adam() -> None:
    """Make megatron-core build torch's ``AdamW`` (and read its state as torch's) whether or not
    Transformer Engine or Apex is installed.

    megatron-core 0.19.2 decides at import: with TE (every NGC container) or Apex, its Adam is their
    ``FusedAdam`` (``optimizer/__init__.py``: ``USING_PYTORCH_OPTIMIZER = False``) and its distributed
    optimizer reads and restores the state on the fused layout (``distrib_optimizer.HAVE_APEX_OR_TE``:
    the ``step`` kept per group). This launcher's checkpoint handling (the state made before a load and
    the per-parameter ``step`` restored after it, :mod:`k2.launcher.checkpointing.loading`), QK-Clip's
    rescaling of master copies and the optimizer offload are written and tested against torch's
    ``AdamW`` on megatron's torch path; the fused one has never run here. Idempotent."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer import distrib_optimizer

    mcore_optimizer.USING_PYTORCH_OPTIMIZER = True  # -> torch.optim.AdamW (decoupled weight decay)
    distrib_optimizer.HAVE_APEX_OR_TE = False
    distrib_optimizer.USING_TE_OPTIMIZER = distrib_optimizer.USING_APEX_OPTIMIZER = False


def build_optimizer(optim_cfg: OptimConfig, model: list, tcfg, schedule, use_distributed_optimizer: bool):
    """The run's megatron optimizer: the ``build`` of ``optim.name``'s
    :class:`k2.optim.registry.OptimizerSpec` (the module docstring describes AdamW and MuonClip).

    The learning rate and weight decay of every param group come from the schedule
    (``k2.schedules.lr.TokenLRScheduler`` sets them before every step; Muon and AdamW groups alike); which
    parameters are decayed is ``optim.decay_all_params`` (:func:`k2.optim.params.weight_decayed`).

    Args:
        optim_cfg: the ``optim`` section.
        model: DDP-wrapped chunks from :func:`k2.parallel.distributed.wrap_model`; their parameters must
            have been tagged by :func:`k2.optim.params.tag_parameters` first.
        tcfg: megatron ``TransformerConfig`` (precision).
        schedule: the resolved :class:`k2.schedules.wsd.Schedule` (its peak and final LR; the
            scheduler sets every step's LR and weight decay).
        use_distributed_optimizer: ``k2.parallel.use_distributed_optimizer`` (ZeRO-1 over DP).

    Returns:
        ``MegatronOptimizer`` (a ``ChainedOptimizer``); grad-norm clipping at ``k2.optim.clip_grad`` over
        all parameters of both optimizers (global norm over all ranks).

    Raises:
        ValueError: an unknown ``optim.name``.
    """
    return optimizer_spec(optim_cfg.name).build(optim_cfg, model, tcfg, schedule, use_distributed_optimizer)


def megatron_settings(optim_cfg: OptimConfig, tcfg, schedule, use_distributed_optimizer: bool) -> dict:
    """The ``OptimizerConfig`` arguments every optimizer here shares: the schedule's LR settings, Adam's
    betas and eps (the Adam part of any optimizer), grad-norm clipping, the parameter dtype and ZeRO-1.
    Also makes megatron build torch's AdamW (:func:`use_torch_adam`)."""
    use_torch_adam()
    o = optim_cfg
    return dict(
        **optimizer_lr_settings(schedule),
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        params_dtype=tcfg.params_dtype,
        use_distributed_optimizer=bool(use_distributed_optimizer),
    )


def decay_overrides(optim_cfg: OptimConfig):
    """megatron's ``config_overrides`` for ``optim.decay_all_params`` (:func:`k2.optim.params.weight_decayed`):
    megatron's documented way to decay every parameter is an empty override dict; None selects its default
    (wd_mult 0 on 1-D tensors and biases)."""
    return {} if optim_cfg.decay_all_params else None


def _build_adamw(optim_cfg: OptimConfig, model: list, tcfg, schedule, use_distributed_optimizer: bool):
    """``optim=adamw``: megatron's Adam (torch's AdamW) over every parameter (module docstring)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    common = megatron_settings(optim_cfg, tcfg, schedule, use_distributed_optimizer)
    ocfg = OptimizerConfig(optimizer="adam", bf16=tcfg.bf16, **common)
    optimizer = get_megatron_optimizer(ocfg, model, config_overrides=decay_overrides(optim_cfg))
    return _with_offload(optim_cfg, optimizer)


def _build_muonclip(optim_cfg: OptimConfig, model: list, tcfg, schedule, use_distributed_optimizer: bool):
    """``optim=muonclip``: K2Muon for the Muon matrices, megatron's Adam for the rest (module docstring)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = optim_cfg
    common = megatron_settings(o, tcfg, schedule, use_distributed_optimizer)
    overrides = decay_overrides(o)
    _register_k2_muon()
    place = optimizer_spec(o.name).placement(o, use_distributed_optimizer)
    ocfg = OptimizerConfig(
        optimizer=K2_MUON,
        # layer-wise ZeRO-1: bf16=True selects megatron's mixed-precision wrapper, which fp32 parameters
        # also need there (module docstring); it keeps fp32 parameters as their own master copy.
        bf16=True if place.layer_wise else tcfg.bf16,
        use_layer_wise_distributed_optimizer=place.layer_wise,
        **_megatron_muon_settings(o),
        **common,
    )
    if place.zero1_muon and not place.layer_wise:
        return _with_offload(o, _byte_range_muonclip(ocfg, model, overrides))
    optimizer = get_megatron_optimizer(ocfg, model, config_overrides=overrides)
    _copy_splits_to_master_params(model)
    return optimizer


def _with_offload(optim_cfg: OptimConfig, optimizer):
    """``optimizer`` (megatron's ``ChainedOptimizer``) as a :class:`k2.optim.offload.OffloadedOptimizer` when
    ``optim.offload_fraction > 0`` (its distributed optimizers' states in host memory between steps)."""
    if not optim_cfg.offload_fraction:
        return optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from k2.optim.offload import OffloadedOptimizer, StateOffload

    leaves = [x for x in leaf_optimizers(optimizer) if isinstance(x, DistributedOptimizer)]
    return OffloadedOptimizer(
        list(optimizer.chained_optimizers), StateOffload(leaves, float(optim_cfg.offload_fraction))
    )


def _megatron_muon_settings(optim_cfg: OptimConfig) -> dict:
    """MuonClip's own settings (:func:`k2.config.schema.optimizer_settings`) that megatron's
    ``OptimizerConfig`` also has, under the same names (``muon_momentum``, ``muon_nesterov``, ...)."""
    from dataclasses import fields

    from megatron.core.optimizer import OptimizerConfig

    megatron = {f.name for f in fields(OptimizerConfig)}
    return {k: getattr(optim_cfg, k) for k in optimizer_settings("muonclip") if k in megatron}


def _muon_kwargs(config) -> dict:
    """:class:`k2.optim.muon.K2Muon`'s arguments from megatron's ``OptimizerConfig`` (both the layer-wise
    and the byte-range path build it from these)."""
    return dict(
        lr=config.lr,
        momentum=config.muon_momentum,
        weight_decay=config.weight_decay,
        nesterov=config.muon_nesterov,
        coefficient_type=config.muon_coefficient_type,
        num_ns_steps=config.muon_num_ns_steps,
        scale_mode=config.muon_scale_mode,
        extra_scale_factor=config.muon_extra_scale_factor,
        fp32_matmul_prec=config.muon_fp32_matmul_prec,
    )


def _byte_range_muonclip(ocfg, model: list, overrides):
    """MuonClip on megatron's byte-range ``DistributedOptimizer`` (``optim.muon_zero1=byte_range``).

    megatron's own ``get_megatron_optimizer`` loop, with the Muon/AdamW split added: for dense and for
    expert parameters (their DP group: the expert-DP group), one
    :class:`k2.optim.distributed_muon.DistributedMuonOptimizer` over the buffers holding the Muon
    matrices and one megatron Adam ``DistributedOptimizer`` over the other buffers, chained.
    """
    import copy

    from megatron.core.optimizer import ChainedOptimizer, _get_megatron_optimizer_based_on_param_groups
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_pg_rank

    from k2.optim.distributed_muon import DistributedK2Muon, DistributedMuonOptimizer

    pgs = ProcessGroupCollection.setup_process_groups_for_optimizer(None, model, True)
    tp = ProcessGroupCollection.use_mpu_process_groups()
    adam_cfg = copy.copy(ocfg)
    adam_cfg.optimizer = "adam"
    parts = []
    for (expert, muon), sub in _muonclip_param_groups(ocfg, model, overrides).items():
        if expert:
            mp, dp, gloo = (
                pgs["expt_tp_pp_with_egtp_remat_group"],
                pgs["intra_expt_dp_group"],
                pgs["intra_expt_dp_group_gloo"],
            )
        else:
            mp, dp, gloo = pgs["mp_group"], pgs["intra_dp_cp_group"], pgs["intra_dp_cp_group_gloo"]
        buffers = _part_buffers(model, expert, muon)
        if muon:
            opt = DistributedMuonOptimizer(
                DistributedK2Muon(sub, **_muon_kwargs(ocfg)), ocfg, model, buffers, dp, gloo, get_pg_rank(mp)
            )
            opt.grad_stats_parallel_group = pgs["intra_dist_opt_group"]
            opt.tp_group, opt.expert_tp_group = tp.tp, getattr(tp, "expt_tp", tp.tp)
        else:
            opt = _get_megatron_optimizer_based_on_param_groups(
                config=adam_cfg,
                model_chunks=model,
                param_groups=sub,
                per_model_buffers=buffers,
                model_parallel_group=mp,
                data_parallel_group=dp,
                data_parallel_group_gloo=gloo,
                data_parallel_group_idx=get_pg_rank(mp),
                intra_dist_opt_group=pgs["intra_dist_opt_group"],
                distributed_optimizer_instance_id=0,
            )
            opt.config = ocfg  # megatron's ChainedOptimizer expects one config
        parts.append(opt)
    return ChainedOptimizer(parts)


def _muonclip_param_groups(ocfg, model: list, overrides) -> dict[tuple[bool, bool], list[dict]]:
    """Collective: megatron's param groups split into the parts of byte-range MuonClip, ``(expert, muon)`` ->
    the groups with those parameters only, in the order dense Muon, dense AdamW, expert Muon, expert AdamW."""
    import torch
    from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides

    # megatron aligns the param groups over all ranks (its checkpoints need the same optimizer structure
    # everywhere); so is the set of parts: a part with parameters on no rank (e.g. AdamW for experts,
    # whose weights are all Muon matrices) is left out everywhere
    groups = _get_param_groups(model, ocfg, get_standard_config_overrides(ocfg) if overrides is None else overrides)
    keys = [(expert, muon) for expert in (False, True) for muon in (True, False)]
    split = {
        (e, m): [
            {**g, "params": [p for p in g["params"] if (getattr(p, ROUTE_ATTR, "adamw") == "muon") == m]}
            for g in groups
            if g["is_expert_parallel"] == e
        ]
        for e, m in keys
    }
    counts = torch.tensor(
        [sum(len(g["params"]) for g in split[k]) for k in keys], device="cuda" if torch.cuda.is_available() else "cpu"
    )
    torch.distributed.all_reduce(counts)
    return {k: split[k] for k, n in zip(keys, counts.tolist()) if n}


def _part_buffers(model: list, expert: bool, muon: bool) -> dict[int, list]:
    """The DDP buffers of one part, by model chunk index: the chunk's (expert-parallel, with ``expert``)
    buffers whose parameters are Muon matrices (``muon``) or not; chunks without one are left out."""
    buffers = {}
    for i, chunk in enumerate(model):
        bufs = [
            b
            for b in getattr(chunk, "expert_parallel_buffers" if expert else "buffers", [])
            if b.params and bool(getattr(b.params[0], LAYER_WISE_ATTR, False)) == muon
        ]
        if bufs:
            buffers[i] = bufs
    return buffers


def shard_straddlers(full_param_layout) -> list:
    """Parameters that a ZeRO-1 shard boundary cuts, in a megatron ``FullParamLayout``.

    Each bucket of a buffer is split into ``num_optimizer_shards`` equal contiguous shards, one per DP
    rank; a parameter whose element range ``[start, end)`` spans two shards is updated piecewise by two
    ranks. Newton-Schulz needs the whole matrix, so under MuonClip no Muon parameter may be returned
    here (megatron's layer-wise layout guarantees it; its byte-range layout does not).

    Args:
        full_param_layout: ``DistributedDataParallel.full_param_layout`` or the result of
            ``DistributedOptimizer`` / ``LayerWiseDistributedOptimizer.compute_full_param_layout``.

    Returns:
        the cut parameters (empty when there are none or the layout has one shard).
    """
    out = []
    for layout in full_param_layout.layouts.values():
        shards = layout.num_optimizer_shards or 1
        for p, (start, end, bucket) in layout.param_index_map.items():
            b_start, b_end = layout.bucket_indices[bucket]
            size = (b_end - b_start) // shards
            if (start - b_start) // size != (end - 1 - b_start) // size:
                out.append(p)
    return out


#: this module's optimizers (:mod:`k2.optim.registry`)
SPECS = (
    OptimizerSpec("adamw", _build_adamw, ADAMW_UPDATE),
    OptimizerSpec(
        "muonclip",
        _build_muonclip,
        ADAMW_UPDATE,
        matrix=MUON_UPDATE,
        matrix_step=MatrixStep(iterations=5, gemms=newton_schulz_gemms),
        settings=optimizer_settings("muonclip"),
    ),
)
