"""Distributed Muon on megatron's byte-range ZeRO-1 ("Muon is Scalable for LLM Training", arXiv 2502.16982,
section 2.3, "Distributed Muon"; DeepSpeed's ZeRO-1/2 Muon does the same for the matrices a shard boundary
cuts).

megatron-core's ``DistributedOptimizer`` splits each bucket of DDP's contiguous gradient/parameter buffer
into ``dp`` equal byte ranges without regard to parameter boundaries (no padding between parameters); the
reduce-scatter leaves each DP rank the DP-summed gradient of its range, and the rank keeps FP32 master
weights and optimizer states for that range only. Newton-Schulz needs whole matrices, so per step:

1. On its range, each rank applies the decoupled weight decay, updates the momentum and forms the
   Nesterov momentum ``N`` (all element-wise: exactly what one rank would compute for those elements).
2. A Muon matrix inside this rank's range is orthogonalised here, whole. A matrix that *straddles* a
   shard boundary is gathered: every rank writes its part of ``N`` (cast to the parameter dtype: BF16 in
   BF16 runs, as Moonlight gathers it) into one flat buffer holding all straddling matrices of the
   optimizer and one all-reduce (sum; the parts do not overlap, so the sum is a copy) over the DP group
   gives every rank the whole ``N`` of each; the ranks that own a part of a matrix orthogonalise it,
   whole, and each keeps its slice of the update.
3. megatron copies the updated master shards into the parameter buffer and all-gathers it, as for AdamW.

Newton-Schulz stays per reference matrix (:meth:`k2.optim.muon.K2Muon.orthogonalize`: each expert, the
SwiGLU gate and up projections separately, MLA's projections each one matrix). In FP32 the update of every
element equals the single-rank update bit for bit.

Ours because megatron-core 0.19.2 has no such optimizer: its emerging-optimizer path runs Muon either
undistributed or through ``LayerWiseDistributedOptimizer`` (whole matrices bin-packed into padded DP
shards: up to 2x the parameter and gradient bytes of the byte-range layout on K2's PP rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from emerging_optimizers import utils as eo_utils
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from k2.optim.muon import SPLIT_ATTR, K2Muon

#: Attribute of a master shard: ``(shape of the whole parameter, start, end)`` of the shard in the
#: flattened parameter.
PIECE_ATTR = "k2_muon_piece"


@dataclass(frozen=True)
class Piece:
    """Where a rank's master shard lies in its parameter.

    Attributes:
        shape: the whole parameter's shape (``[out, in]`` or ``[E, out, in]``).
        start, end: the shard's element range in the flattened parameter (``end - start`` = shard numel).
        straddle_offset: offset of the whole parameter in the optimizer's flat straddle buffer; None when
            the shard is the whole parameter.
    """

    shape: tuple
    start: int
    end: int
    straddle_offset: int | None


def straddling_params(buffers) -> list:
    """The parameters of megatron ``_ParamAndGradBuffer`` s that a DP shard boundary cuts, in buffer order.

    Every rank computes the same list (it depends on the layout only). A bucket of ``n`` elements is
    split into ``dp`` shards of ``n / dp`` (megatron pads each bucket to a multiple of ``dp``).
    """
    out = []
    for buffer in buffers:
        dp = buffer.data_parallel_group.size()
        if dp == 1:
            continue
        for p, (start, end, b) in sorted(buffer.param_index_map.items(), key=lambda kv: kv[1][0]):
            bucket = buffer.buckets[b]
            size = bucket.grad_data.numel() // dp
            if (start - bucket.offset) // size != (end - 1 - bucket.offset) // size:
                out.append(p)
    return out


class DistributedK2Muon(K2Muon):
    """:class:`k2.optim.muon.K2Muon` over megatron's 1-D master shards (module docstring, steps 1-2).

    Parameters without :data:`PIECE_ATTR` are whole and stepped as :class:`K2Muon` steps them.
    :meth:`set_straddle_buffer` sets the flat buffer's size, dtype and DP group before the first step.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.straddle_numel = 0
        self.straddle_dtype = torch.float32
        self.group = None

    def set_straddle_buffer(self, numel: int, dtype: torch.dtype, group) -> None:
        """``numel``: elements of all straddling parameters together; ``dtype``: the gather dtype (the
        parameters'); ``group``: the DP group of the shards."""
        self.straddle_numel, self.straddle_dtype, self.group = int(numel), dtype, group

    @torch.no_grad()
    def step(self, closure=None):
        """One step (module docstring). Collective over the DP group when any parameter straddles.

        Raises:
            ValueError: a closure is passed.
        """
        if closure is not None:
            raise ValueError("closure is not supported")
        todo = []  # (param, group, Nesterov momentum of the shard)
        for group in self.param_groups:
            self._init_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                self._apply_weight_decay_inplace(p, p.grad, group["lr"], group["weight_decay"])
                state["momentum_buffer"].lerp_(p.grad, 1 - group["momentum"])
                n = (
                    p.grad.lerp(state["momentum_buffer"], group["momentum"])
                    if self.nesterov
                    else state["momentum_buffer"]
                )
                todo.append((p, group, n))
        flat = None
        if self.straddle_numel:
            dev = todo[0][0].device if todo else torch.device("cuda" if torch.cuda.is_available() else "cpu")
            flat = torch.zeros(self.straddle_numel, dtype=self.straddle_dtype, device=dev)
            for p, _, n in todo:
                piece: Piece | None = getattr(p, PIECE_ATTR, None)
                if piece is not None and piece.straddle_offset is not None:
                    o = piece.straddle_offset
                    flat[o + piece.start : o + piece.end].copy_(n.reshape(-1))
            torch.distributed.all_reduce(flat, group=self.group)
        for p, group, n in todo:
            piece = getattr(p, PIECE_ATTR, None)
            if piece is None:
                full = n
            elif piece.straddle_offset is None:
                full = n.view(piece.shape)
            else:
                numel = int(torch.Size(piece.shape).numel())
                o = piece.straddle_offset
                full = flat[o : o + numel].view(piece.shape).to(n.dtype)
            with eo_utils.fp32_matmul_precision(self.fp32_matmul_prec):
                orth = self.orthogonalize(p, full, **{k: v for k, v in group.items() if k != "params"})
            if piece is not None:
                orth = orth.reshape(-1)[piece.start : piece.end]
            p.add_(orth.view_as(p), alpha=-group["lr"])
        return None


def _init_momentum(opt, config=None) -> None:
    """megatron's ``init_state_fn`` (checkpoint loading): a zero momentum per shard."""
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


class DistributedMuonOptimizer(DistributedOptimizer):
    """megatron's byte-range ``DistributedOptimizer`` running :class:`DistributedK2Muon` over the buffers
    holding the Muon matrices (they sit in their own DDP buffers: megatron's buffer key
    ``is_managed_by_layer_wise_optimizer``, set by :func:`k2.optim.params.tag_parameters`).

    Args:
        optimizer: a :class:`DistributedK2Muon` over the Muon parameters (megatron param groups).
        config, model_chunks, per_model_buffers, data_parallel_group, data_parallel_group_gloo,
        data_parallel_group_idx: as megatron's ``DistributedOptimizer`` (no grad scaler: BF16 or FP32).

    What differs from megatron's class: the state keys (``momentum_buffer``, for its checkpoint code,
    which assumes Adam's ``exp_avg``/``exp_avg_sq`` otherwise), the parameter all-gather of its own
    buckets (megatron's skips buckets tagged for a layer-wise optimizer), and the straddle plan written
    onto the master shards after megatron has built them.
    """

    def __init__(
        self,
        optimizer: DistributedK2Muon,
        config,
        model_chunks,
        per_model_buffers,
        data_parallel_group,
        data_parallel_group_gloo,
        data_parallel_group_idx,
    ) -> None:
        super().__init__(
            optimizer,
            config,
            None,
            _init_momentum,
            model_chunks,
            per_model_buffers,
            data_parallel_group,
            data_parallel_group_gloo,
            data_parallel_group_idx,
            0,
        )
        self.straddlers = straddling_params(self.buffers)
        offsets, total = {}, 0
        for p in self.straddlers:
            offsets[p] = total
            total += p.numel()
        pairs = list(zip(self.model_float16_groups, self.shard_fp32_from_float16_groups)) + list(
            zip(self.model_fp32_groups, self.shard_fp32_groups)
        )
        for model_group, shard_group in pairs:
            for model_param, shard in zip(model_group, shard_group):
                rng = self._get_model_param_range_map(model_param)["param"]
                setattr(
                    shard, PIECE_ATTR, Piece(tuple(model_param.shape), rng.start, rng.end, offsets.get(model_param))
                )
                split = getattr(model_param, SPLIT_ATTR, None)
                if split is not None:
                    setattr(shard, SPLIT_ATTR, split)
        dtype = self.buffers[0].param_dtype if self.buffers else torch.float32
        optimizer.set_straddle_buffer(total, dtype, data_parallel_group)

    @property
    def optimizer_state_keys(self):
        """Muon's one state tensor per shard."""
        return ("momentum_buffer",)

    def state_dict(self):
        """The non-parameter state (param groups), as megatron's ``state_dict``.

        megatron's reads the per-tensor ``step`` torch's Adam keeps (without Apex/Transformer Engine) and
        its ``load_state_dict`` expects one in every param group; Muon keeps none, so the groups carry
        ``step`` 0 (unused by Muon).
        """
        inner = self.optimizer.state_dict()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": 0} for g in inner["param_groups"]]
        return {
            "optimizer": {
                **{k: v for k, v in inner.items() if k not in ("state", "param_groups")},
                "param_groups": groups,
            }
        }

    def load_state_dict(self, state_dict) -> None:
        """megatron's ``load_state_dict``, without the ``step`` it adds to every state and param group
        (Muon keeps none; megatron's ``ChainedOptimizer`` requires the groups' steps to agree)."""
        super().load_state_dict(state_dict)
        for st in self.optimizer.state.values():
            st.pop("step", None)
        for group in self.optimizer.param_groups:
            group.pop("step", None)

    def _set_main_param_and_optimizer_states(self, model_param, tensors) -> None:
        """megatron's copy of one parameter's loaded shard into the master shard and its momentum; the
        ``step`` its ``load_state_dict`` has just added to the state (torch Adam's, absent from Muon's
        checkpoint) is dropped first, else megatron looks it up in the loaded tensors (KeyError)."""
        group_index, group_order = self.model_param_group_index_map[model_param]
        self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]].pop("step", None)
        super()._set_main_param_and_optimizer_states(model_param, tensors)

    def start_param_sync_for_bucket_group_subset(self) -> None:
        """All-gather the parameters of this optimizer's own buckets (megatron's ``start_param_sync``)."""
        mine = {id(b) for buffer in self.buffers for b in buffer.buckets}
        for chunk in self.model_chunks:
            for bucket_group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if bucket_group.buckets and id(bucket_group.buckets[0]) in mine:
                    chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)
