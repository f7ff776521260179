"""The training state on each GPU before a job runs: parameters, gradient buffers, optimizer states. (The
activations, the other part of GPU memory, are :mod:`k2.launcher.planning.stage_activations`.)

State bytes (parameters, gradients, optimizer) are what megatron-core allocates for the layout, computed
with megatron's *own* buffer-layout functions so that padding and ZeRO-1 sharding are exactly the
trainer's (checked against a real 4-rank gloo run in ``tests/unit/launcher/planning/test_memory_plan.py``):

* each PP rank's model chunks get their parameter list (:mod:`k2.launcher.planning.chunk_params`: names and
  shapes from :func:`k2.model.params.count_params`'s meta-device model, as
  :class:`~k2.launcher.planning.chunk_params.LayoutParam` stand-ins tagged like the trainer tags the parameters);
* megatron's ``DistributedOptimizer.compute_full_param_layout`` (byte-range ZeRO-1: ``optim=adamw``, and
  ``optim=muonclip`` with ``optim.muon_zero1=byte_range``, the Distributed Muon of
  :mod:`k2.optim.distributed_muon`) or ``LayerWiseDistributedOptimizer.compute_full_param_layout`` (whole
  matrices bin-packed into the DP shards, ``optim.muon_zero1=layer_wise``) lays each chunk's parameters into
  DDP's contiguous buffers: one buffer per (dtype, expert, Muon) group, a parameter starting on a 64-element
  boundary, each buffer padded to a multiple of ``lcm(dp, 128)`` (``optimizer/param_layout.py``). Without
  ``k2.parallel.use_distributed_optimizer`` the buffers are unpadded
  (``_compute_default_per_buffer_param_layout``).

Then, per GPU (``train.precision`` sets the parameter dtype; the gradient buffers are FP32,
``grad_reduce_in_fp32`` in :func:`k2.parallel.distributed.ddp_config`, the trainer's):

* ``params``: the parameter buffers (padded numel x 2 B for BF16, 4 B for FP32) with the distributed
  optimizer; the parameters themselves without it;
* ``grads``: the gradient buffers, padded numel x 4 B;
* ``optimizer``: for each parameter the elements this DP rank updates (its overlap with the rank's shard:
  ``buffer / dp`` per bucket, the expert buffers over the expert-DP group ``dp / ep``; the layer-wise layout
  gives whole matrices to one rank; all of it without the distributed optimizer): an FP32 master copy (4
  B/element, only for BF16 parameters: FP32 parameters are their own master copy), AdamW's two moments (8
  B/element) or Muon's momentum (4 B/element), and the optimizer's per-tensor step counter (a 4-byte scalar per
  (sharded) tensor, torch's AdamW; emerging-optimizers' Muon keeps none). ``optim.offload_fraction`` of it lives
  in host memory (megatron's ``optimizer_cpu_offload``; K2 offloads part of the states at 32 nodes).

K2's check (docs/k2_reference.md "Training system"): BF16 parameters + FP32 gradients = 6 B x 1.026T = 6.16 TB over
256 GPUs, 24 GB per GPU on average.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k2.launcher.planning.chunk_params import chunk_kinds, chunk_params
from k2.launcher.planning.host_pinned import pinned_block_bytes
from k2.optim.registry import OptimizerSpec, Placement, optimizer_spec
from k2.parallel.distributed import ddp_config

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig, OptimConfig

__all__ = [
    "StateBytes",
    "state_bytes",
    "state_bytes_lower_bound",
]

_DTYPE_BYTES = {"fp32": 4, "bf16": 2}
_MASTER_BYTES = 4  # FP32 master copy of a BF16 parameter


@dataclass(frozen=True)
class StateBytes:
    """Parameter, gradient and optimizer bytes of one GPU.

    Attributes:
        pp_rank, dp_rank, expert_dp_rank: the GPU's coordinates.
        params: parameter bytes (DDP's param buffers, or the parameters).
        grads: DDP's FP32 gradient buffers.
        optimizer: master copies + optimizer states + step counters, before any CPU offload.
        param_numel: elements of this GPU's parameters (unpadded).
        buffer_numel: elements of its DDP buffers (padded).
        params_pinned: its parameters as pinned host buffers, one per tensor
            (:func:`k2.launcher.planning.host_pinned.pinned_block_bytes`: a checkpoint's staged copy).
        optimizer_pinned: its master copies and optimizer states as pinned host buffers, one per tensor
            (the optimizer offload, a checkpoint's staged copy; step counters stay where torch keeps them).
    """

    pp_rank: int
    dp_rank: int
    expert_dp_rank: int
    params: int
    grads: int
    optimizer: int
    param_numel: int
    buffer_numel: int
    params_pinned: int = 0
    optimizer_pinned: int = 0


def _layout(params: list, dims, use_distributed_optimizer: bool, layer_wise: bool):
    """megatron's ``FullParamLayout`` of one chunk (the call ``DistributedDataParallel.__init__`` makes,
    or the one :func:`k2.parallel.distributed.wrap_model` passes in for the layer-wise optimizer);
    ``layer_wise``: megatron's layer-wise layout (``optim.muon_zero1=layer_wise``), else the byte-range one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed.param_and_grad_buffer import (
            _compute_default_per_buffer_param_layout,
            group_params_for_buffers,
        )
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
        from megatron.core.optimizer.param_layout import FullParamLayout

    cfg = ddp_config(use_distributed_optimizer)
    if use_distributed_optimizer:
        cls = LayerWiseDistributedOptimizer if layer_wise else DistributedOptimizer
        return cls.compute_full_param_layout(params, None, dims.dp, cfg, expert_data_parallel_world_size=dims.expert_dp)
    layouts = {}
    for key, (group, _) in group_params_for_buffers(params, cfg.grad_reduce_in_fp32).items():
        layouts[key] = _compute_default_per_buffer_param_layout(group, None)
    return FullParamLayout(layouts=layouts)


def _chunk_state(
    counts,
    dims,
    kinds: tuple,
    has_embedding: bool,
    has_loss: bool,
    *,
    precision: str,
    spec: OptimizerSpec,
    place: Placement,
    use_distributed_optimizer: bool,
    model_cfg: ModelConfig,
) -> tuple:
    """``(param_numel, buffer_numel, optimizer bytes per DP rank, per expert-DP rank, params_pinned,
    optimizer pinned bytes per DP rank, per expert-DP rank)`` of one chunk (:class:`StateBytes`); ``spec``:
    the optimizer (its routes and their state bytes); ``place``: where it puts the parameters."""
    master = _MASTER_BYTES if precision == "bf16" else 0
    # (layer_wise=: megatron's flag on the Muon matrices that sit in DDP buffers of their own)
    params = chunk_params(
        counts,
        kinds,
        has_embedding,
        has_loss,
        dims.ep,
        precision=precision,
        muon=place.muon,
        layer_wise=place.zero1_muon,
        model_cfg=model_cfg,
        router_optimizer=place.router_optimizer,
        default_route=spec.default.route,
        tp=dims.tp,
    )
    dense_opt, expert_opt = [0] * dims.dp, [0] * dims.expert_dp
    dense_pin, expert_pin = [0] * dims.dp, [0] * dims.expert_dp
    buffer_numel = params_pinned = 0
    layout = _layout(params, dims, use_distributed_optimizer, place.layer_wise)
    for key, lay in layout.layouts.items():
        buffer_numel += lay.bucket_indices[-1][1] if lay.bucket_indices else 0
        group = dims.expert_dp if key.is_expert_parallel else dims.dp
        acc, pin = (expert_opt, expert_pin) if key.is_expert_parallel else (dense_opt, dense_pin)
        for p, (start, end, bucket) in lay.param_index_map.items():
            b_start, b_end = lay.bucket_indices[bucket]
            update = spec.updates[p.k2_optimizer]
            per_elem = master + update.state_bytes
            per_tensor = update.step_bytes
            # one FP32 host buffer each: the master copy (BF16 parameters) and every state tensor
            pinned_tensors = (1 if master else 0) + update.state_bytes // 4
            params_pinned += pinned_block_bytes((end - start) * _DTYPE_BYTES[precision])
            if not use_distributed_optimizer:  # every rank updates every parameter
                for d in range(group):
                    acc[d] += (end - start) * per_elem + per_tensor
                    pin[d] += pinned_tensors * pinned_block_bytes(4 * (end - start))
                continue
            size = (b_end - b_start) // group  # the DP shards of this bucket
            for d in range((start - b_start) // size, (end - 1 - b_start) // size + 1):
                lo, hi = b_start + d * size, b_start + (d + 1) * size
                acc[d] += (min(end, hi) - max(start, lo)) * per_elem + per_tensor
                pin[d] += pinned_tensors * pinned_block_bytes(4 * (min(end, hi) - max(start, lo)))
    return (
        sum(p.nelement() for p in params),
        buffer_numel,
        dense_opt,
        expert_opt,
        params_pinned,
        dense_pin,
        expert_pin,
    )


def state_bytes_lower_bound(counts, dims, *, precision: str) -> list[list[StateBytes]]:
    """A cheap lower bound of :func:`state_bytes`: unpadded parameters and FP32 gradients, no optimizer.
    ``k2-plan``'s search uses it to set aside layouts that cannot fit before laying out their buffers."""
    out = []
    for r in range(dims.pp):
        layers, emb, loss = dims.pp_rank_contents(r)
        n = counts.stage(layers, emb, loss, ep=dims.ep, tp=dims.tp)
        out.append(
            [StateBytes(r, d, d % dims.expert_dp, n * _DTYPE_BYTES[precision], n * 4, 0, n, n) for d in range(dims.dp)]
        )
    return out


def state_bytes(
    counts,
    dims,
    *,
    precision: str,
    optim: OptimConfig,
    use_distributed_optimizer: bool,
    model_cfg: ModelConfig,
    cache: dict | None = None,
) -> list[list[StateBytes]]:
    """Parameter, gradient and optimizer bytes of every GPU position (module docstring).

    Args:
        counts: :func:`k2.model.params.count_params` of the model.
        dims: :class:`k2.parallel.dims.ParallelDims`.
        precision: ``train.precision`` (``bf16`` | ``fp32``).
        optim: the ``optim`` section: its optimizer's spec (:func:`k2.optim.registry.optimizer_spec`) gives the
            routes, their state bytes and where the parameters go (:class:`k2.optim.registry.Placement`).
        use_distributed_optimizer: ``k2.parallel.use_distributed_optimizer`` (ZeRO-1).
        model_cfg: ``cfg.model``.
        cache: a dict kept across calls for the same model, precision and optimizer (``k2-plan``'s
            search): chunks with the same layers, embedding/loss, ep, dp and expert-DP are laid out once.

    Returns:
        ``out[pp_rank][dp_rank]`` (the expert-DP rank of DP rank ``d`` is taken as ``d % expert_dp``; the
        expert part is the same for every expert-DP rank up to one matrix).

    Raises:
        ValueError: an unknown precision or optimizer.
    """
    if precision not in _DTYPE_BYTES:
        raise ValueError(f"train.precision={precision!r}; allowed: {', '.join(_DTYPE_BYTES)}")
    spec = optimizer_spec(optim.name)
    place = spec.placement(optim, use_distributed_optimizer)
    cache = {} if cache is None else cache
    pbytes = _DTYPE_BYTES[precision]
    out = []
    for r in range(dims.pp):
        param_numel, buffer_numel, dense_opt, expert_opt, params_pinned, dense_pin, expert_pin = _pp_rank_state(
            counts,
            dims,
            r,
            precision=precision,
            spec=spec,
            place=place,
            use_distributed_optimizer=use_distributed_optimizer,
            model_cfg=model_cfg,
            cache=cache,
        )
        params_bytes = (buffer_numel if use_distributed_optimizer else param_numel) * pbytes
        row = []
        for d in range(dims.dp):
            e = d % dims.expert_dp
            row.append(
                StateBytes(
                    r,
                    d,
                    e,
                    params_bytes,
                    buffer_numel * 4,
                    dense_opt[d] + expert_opt[e],
                    param_numel,
                    buffer_numel,
                    params_pinned,
                    dense_pin[d] + expert_pin[e],
                )
            )
        out.append(row)
    return out


def _pp_rank_state(
    counts,
    dims,
    r: int,
    *,
    precision: str,
    spec: OptimizerSpec,
    place: Placement,
    use_distributed_optimizer: bool,
    model_cfg: ModelConfig,
    cache: dict,
) -> tuple:
    """:func:`_chunk_state`'s tuple summed over the model chunks of PP rank ``r`` (the per-rank lists
    element-wise); ``cache`` keeps each distinct chunk's, so chunks alike are laid out once."""
    buffer_numel = param_numel = params_pinned = 0
    dense_opt, expert_opt = [0] * dims.dp, [0] * dims.expert_dp
    dense_pin, expert_pin = [0] * dims.dp, [0] * dims.expert_dp
    for v in range(dims.vpp):
        emb, loss = dims.stage_has_embedding(r, v), dims.stage_has_loss(r, v)
        kinds = chunk_kinds(counts, dims, r, v)
        key = (
            kinds,
            emb,
            loss,
            dims.tp,
            dims.ep,
            dims.dp,
            dims.expert_dp,
            precision,
            spec.name,
            use_distributed_optimizer,
            place,
        )
        if key not in cache:
            cache[key] = _chunk_state(
                counts,
                dims,
                kinds,
                emb,
                loss,
                precision=precision,
                spec=spec,
                place=place,
                use_distributed_optimizer=use_distributed_optimizer,
                model_cfg=model_cfg,
            )
        n, b, dense, expert, ppin, dpin, epin = cache[key]
        param_numel, buffer_numel, params_pinned = param_numel + n, buffer_numel + b, params_pinned + ppin
        dense_opt = [x + y for x, y in zip(dense_opt, dense)]
        expert_opt = [x + y for x, y in zip(expert_opt, expert)]
        dense_pin = [x + y for x, y in zip(dense_pin, dpin)]
        expert_pin = [x + y for x, y in zip(expert_pin, epin)]
    return param_numel, buffer_numel, dense_opt, expert_opt, params_pinned, dense_pin, expert_pin
