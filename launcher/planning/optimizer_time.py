"""Seconds of the optimizer step on one GPU for ``k2-plan``'s step-time model.

* **Muon's Newton-Schulz** (``optim.name=muonclip``): 5 iterations per matrix ``X`` of shape ``[m, n]``
  (``m <= n``), each ``A = X X^T`` (``[m, n] x [n, m]``), ``A A`` (``[m, m] x [m, m]``) and ``B X``
  (``[m, m] x [m, n]``): ``5 (4 m^2 n + 2 m^3)`` FLOPs (Keller Jordan's Muon, the quintic iteration the
  Moonlight paper, arXiv 2502.16982, and K2 use), priced as GEMMs (:mod:`k2.launcher.planning.kernels`). Distributed
  Muon (Moonlight section 2.3) gathers each matrix's gradient over the DP group and runs the iteration on
  the ranks whose ZeRO-1 shard holds it: a rank runs ``1 / dp`` of its PP rank's dense matrices and
  ``1 / expert_dp`` of its experts, and all-gathers the FP32 gradients of its matrices (``muon_gather``).
  The embedding, the output head and the router step with AdamW (K2 / Moonlight).
* **The element-wise update** over the rank's ZeRO-1 shard, at the memory bandwidth: per parameter AdamW
  reads the FP32 gradient (4 B), reads and writes the FP32 master and both moments (24 B) and writes the
  BF16 copy (2 B); Muon has one moment (16 B in all + 2 + 4); both read the gradient once more for the
  gradient norm and zero it (8 B).
* **Offloaded states** (``optim.offload_fraction``): that fraction of the master weights and states goes
  to the device and back every step, at the host link rate, exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k2.launcher.planning.comm import host_copy_seconds, ring_seconds
from k2.launcher.planning.hardware import HardwareProfile
from k2.launcher.planning.kernels import KernelRates, gemm_seconds
from k2.launcher.planning.placement import block_crosses
from k2.optim.registry import MatrixStep, optimizer_spec

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig

_MASTER_BYTES = 4  # the FP32 master copy, offloaded with the states
# aten operators of an unfused (per-tensor) optimizer step: k2-train's AdamW on a CPU (megatron's
# distributed optimizer over torch's for-loop AdamW: gradient copy to the FP32 shard, norm, clip, mul,
# lerp, addcmul, sqrt, div, add, the parameter copy back, ...) runs 22 per parameter tensor and 13 once,
# counted with torch's dispatch mode (k2_tiny: 2,169 operators over 98 tensors, 1,641 over 74 with 4
# experts); a fused multi-tensor step (megatron's FusedAdam / torch foreach on CUDA) launches a handful
# for all tensors
_OPS_PER_TENSOR_UNFUSED = 22
_OPS_PER_STEP_UNFUSED = 13


def unfused_operators(tensors: int) -> int:
    """Operators of one unfused optimizer step over ``tensors`` parameter tensors (the counts above)."""
    return tensors * _OPS_PER_TENSOR_UNFUSED + _OPS_PER_STEP_UNFUSED


@dataclass(frozen=True)
class OptimizerTime:
    """Seconds of one optimizer step on the busiest GPU (attributes are the breakdown's terms)."""

    newton_schulz: float
    update: float
    muon_gather: float
    offload: float

    @property
    def total(self) -> float:
        return self.newton_schulz + self.update + self.muon_gather + self.offload


def matrices(model_cfg: ModelConfig, layers: list[int], moe_pattern, ep: int) -> tuple[list, list]:
    """Muon's matrices ``(m, n)`` of the given layers on one GPU: ``(dense, expert)`` lists (expert
    matrices: the GPU's ``num_moe_experts / ep`` experts)."""
    m = model_cfg
    h, H = int(m.hidden_size), int(m.num_attention_heads)
    d_qk, d_r, d_v = int(m.qk_head_dim), int(m.qk_pos_emb_head_dim), int(m.v_head_dim)
    r_q, r_kv = m.q_lora_rank, int(m.kv_lora_rank)
    attn = [(h, int(r_q)), (int(r_q), H * (d_qk + d_r))] if r_q else [(h, H * (d_qk + d_r))]
    attn += [(h, r_kv + d_r), (r_kv, H * (d_qk + d_v)), (H * d_v, h)]
    E = int(m.num_moe_experts or 0)
    f, f_e = int(m.ffn_hidden_size), int(m.moe_ffn_hidden_size or 0)
    f_s = int(m.moe_shared_expert_intermediate_size or 0)
    dense, expert = [], []
    for i in layers:
        dense += attn
        if moe_pattern[i]:
            dense += [(h, 2 * f_s), (f_s, h)] if f_s else []
            expert += [(h, 2 * f_e), (f_e, h)] * (E // ep)
        else:
            dense += [(h, 2 * f), (f, h)]
    return dense, expert


def newton_schulz_seconds(shapes: list, rates: KernelRates, step: MatrixStep) -> float:
    """Seconds of the optimizer's per-matrix ``step`` (Muon: Newton-Schulz) on every ``(m, n)`` of ``shapes``
    (module docstring)."""
    t, per_shape = 0.0, {}  # (a GPU's expert matrices repeat a few shapes thousands of times)
    for a, b in shapes:
        s = per_shape.get((a, b))
        if s is None:
            m, n = min(a, b), max(a, b)
            s = per_shape[a, b] = step.iterations * sum(gemm_seconds(*g, rates) for g in step.gemms(m, n))
        t += s
    return t


def optimizer_time(
    optimizer: str,
    model_cfg: ModelConfig,
    dims,
    layers: list[int],
    moe_pattern,
    *,
    dense_params: int,
    expert_params: int,
    tensors: int,
    profile: HardwareProfile,
    rates: KernelRates,
    offload_fraction: float,
    fused: bool,
) -> OptimizerTime:
    """The optimizer step of one GPU of a PP rank holding ``layers``.

    Args:
        optimizer: ``optim.name`` (its :class:`k2.optim.registry.OptimizerSpec` gives the update's bytes and
            the per-matrix step).
        dense_params / expert_params: the GPU's parameters outside / inside the routed experts.
        tensors: its parameter tensors (for the per-tensor launches of an unfused step).
        rates: the device's rates for the Newton-Schulz GEMMs (BF16 on GPUs).
        fused: a multi-tensor (fused) update; False = per-tensor kernels (torch's CPU path).

    Returns:
        :class:`OptimizerTime`, seconds.
    """
    spec = optimizer_spec(optimizer)
    edp = dims.expert_dp
    shard = dense_params / dims.dp + expert_params / edp
    kernels = 10 if fused else unfused_operators(math.ceil(tensors / dims.dp))
    update = shard * spec.main_update.update_bytes / rates.memory_bytes + kernels * rates.launch_s
    ns = gather = 0.0
    cross = block_crosses(dims.world_size, dims.pp, profile.domain_gpus)
    if spec.matrix_step is not None:
        dense, expert = matrices(model_cfg, layers, moe_pattern, dims.ep)
        ns = (
            newton_schulz_seconds(dense, rates, spec.matrix_step) / dims.dp
            + newton_schulz_seconds(expert, rates, spec.matrix_step) / edp
        )
        dense_numel = sum(a * b for a, b in dense)
        expert_numel = sum(a * b for a, b in expert)
        gather = ring_seconds(4 * dense_numel, dims.dp, cross, profile) + ring_seconds(
            4 * expert_numel, edp, cross, profile
        )
    state = _MASTER_BYTES + spec.main_update.state_bytes
    offload = 2 * host_copy_seconds(offload_fraction * shard * state, profile)
    return OptimizerTime(newton_schulz=ns, update=update, muon_gather=gather, offload=offload)
