"""The fullest GPU of each PP rank, every term: training state (:mod:`k2.launcher.planning.memory`) and
activations (:mod:`k2.launcher.planning.stage_activations`), the largest short-lived buffer of a layer, and
what the GPU holds besides what the model allocates; and the host memory each GPU's offloads pin.

Short-lived buffers (``transient``: one at a time, the larger of)

* the max-logit pass of QK-Clip (``model.attention_backend`` sdpa on CUDA with ``model.max_logit_kernel=torch``
  and ``model.record_max_logits``): one block of ``micro_batch_size x heads x MAX_LOGIT_CHUNK`` query rows'
  scores against the keys before it, in the compute dtype (:func:`max_logit_block_bytes`; K2 at 32K
  tokens: 3.9 GiB in BF16);
  none with the Triton kernel (running row maxima only) or TE (its kernel returns the max);
* the grouped GEMM's stacked expert weights (``model.moe_grouped_gemm``, on CUDA in BF16 by default):
  each grouped GEMM stacks the ``E`` local weight matrices into one ``[E, out, in]`` copy, in forward and
  again in backward, and the grouped weight gradient is another ``[E, out, in]`` tensor
  (``model/grouped_mlp.py``); one of them is alive at a time, the largest is fc1's ``E x 2 ffn x h``.

The two never coexist (the pass runs in attention's forward, the stacks in the MoE layer's), so the
larger counts.

What the GPU holds besides (``reserved``; ``plan.gpu_overheads.*``, estimates until measured, see
``config/schema_planning.py``): the CUDA context and kernels; NCCL's buffers, per communicator that carries
traffic (:func:`nccl_communicators`); cuBLAS/cuDNN workspaces; the caching allocator's fragmentation, a
fraction of the allocated peak (with ``launch.cuda_alloc_conf``'s expandable segments, which ``k2-train``
sets).

Host memory (``host_pinned``): the offloaded optimizer states and activations as pinned buffers hold them
(:mod:`k2.launcher.planning.host_pinned`); ``host`` stays the raw bytes the copies move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from k2.launcher.planning.memory import StateBytes
from k2.launcher.planning.stage_activations import StageActivations
from k2.model.backends import resolve_attention_backend, resolve_grouped_experts

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = [
    "DeviceOverheads",
    "GpuMemory",
    "device_overheads",
    "gpu_memory",
    "max_logit_block_bytes",
    "nccl_communicators",
    "stacked_expert_bytes",
]

_GIB = 2**30


@dataclass(frozen=True)
class DeviceOverheads:
    """GPU bytes besides training state and saved activations (module docstring).

    Attributes:
        max_logit_scores: the max-logit pass's score block (0 when none runs).
        grouped_expert_weights: one stacked ``[E, out, in]`` copy of a layer's local expert weights (0
            without grouped experts).
        cuda_context, nccl, workspaces: fixed bytes.
        fragmentation: a fraction of the allocated peak.
    """

    max_logit_scores: float
    grouped_expert_weights: float
    cuda_context: float
    nccl: float
    workspaces: float
    fragmentation: float

    @property
    def transient(self) -> float:
        return max(self.max_logit_scores, self.grouped_expert_weights)

    def reserved(self, allocated: float) -> float:
        """Bytes besides the allocator's ``allocated`` peak (which includes :attr:`transient`)."""
        return self.cuda_context + self.nccl + self.workspaces + self.fragmentation * allocated


def nccl_communicators(dims) -> int:
    """NCCL communicators of one rank that carry traffic: the default group (world > 1; the trainer's
    per-step agreements), DP and expert-DP (ZeRO-1 reduce-scatter / all-gather), EP (dispatch/combine), PP
    (send/recv) and the embedding group (tied or first/last-stage gradients), TP, and the model-parallel
    group (the global gradient norm), each when it has more than one rank."""
    sizes = [
        dims.world_size,
        dims.dp,
        dims.expert_dp,
        dims.ep,
        dims.pp,
        dims.pp,
        dims.tp,
        dims.pp * math.lcm(dims.tp, dims.ep),
    ]
    return sum(1 for n in sizes if n > 1)


def max_logit_block_bytes(batch: int, heads: int, seq_length: int, element_bytes: int, chunk: int) -> int:
    """Peak bytes of the torch max-logit pass (``model/attention.py: per_head_max_logit``, causal, no
    explicit mask) over ``[batch, heads, seq_length, .]`` queries and keys: the larger of a block of
    ``chunk`` query rows against every key before the block (``chunk x (seq_length - chunk)`` scores for
    the last block) and the diagonal block (``chunk x chunk`` scores, their masked copy and the boolean
    mask). K2 at 32,768 tokens, 64 heads, BF16: 3.9 GiB."""
    rows = min(chunk, seq_length)
    past = batch * heads * rows * max(0, seq_length - rows) * element_bytes
    diagonal = 2 * batch * heads * rows * rows * element_bytes + rows * rows
    return max(past, diagonal)


def stacked_expert_bytes(local_experts: int, ffn: int, hidden: int, element_bytes: int) -> int:
    """Bytes of the largest ``[E, out, in]`` tensor of a grouped-GEMM expert layer
    (``model/grouped_mlp.py``): fc1's stacked weights (``E x 2 ffn x hidden``), made in forward and
    again in backward, and its grouped weight gradient of the same shape. K2 on EP16 (24 local experts)
    in BF16: 1.41 GB."""
    return local_experts * max(2 * ffn * hidden, hidden * ffn) * element_bytes


def device_overheads(cfg: K2Config, dims, seq_length: int, micro_batch_size: int) -> DeviceOverheads:
    """:class:`DeviceOverheads` of one phase (its ``seq_length`` and ``micro_batch_size``) on a CUDA GPU."""
    from k2.model.attention import MAX_LOGIT_CHUNK

    m, o = cfg.model, cfg.plan.gpu_overheads
    B = 2 if cfg.train.precision == "bf16" else 4
    scores = 0
    if (
        m.record_max_logits
        and m.max_logit_kernel == "torch"
        and resolve_attention_backend(m.attention_backend, cuda=True) == "sdpa"
    ):
        scores = max_logit_block_bytes(
            micro_batch_size, int(m.num_attention_heads) // dims.tp, seq_length, B, MAX_LOGIT_CHUNK
        )
    stacked = 0
    if m.num_moe_experts and resolve_grouped_experts(m.moe_grouped_gemm, cfg.train.precision, cuda=True):
        stacked = stacked_expert_bytes(
            int(m.num_moe_experts) // dims.ep, int(m.moe_ffn_hidden_size), int(m.hidden_size), B
        )
    return DeviceOverheads(
        scores,
        stacked,
        float(o.cuda_context_gib) * _GIB,
        nccl_communicators(dims) * float(o.nccl_gib_per_communicator) * _GIB,
        float(o.workspace_gib) * _GIB,
        float(o.fragmentation),
    )


@dataclass(frozen=True)
class GpuMemory:
    """Memory of the fullest GPU of one PP rank, in bytes (module docstrings of
    :mod:`k2.launcher.planning.memory` and :mod:`k2.launcher.planning.stage_activations` for the state and
    activation terms).

    ``optimizer`` is what stays on the GPU after ``optimizer_offload_fraction``; ``activations`` is the
    peak of the microbatches the pipeline schedule holds (+ two layers' worth of offload staging when offloading,
    + one layer's re-run with whole-layer recompute); ``in_flight`` how many (model chunk, microbatch)
    pairs that peak holds; ``transient`` the largest short-lived buffer, ``reserved`` what the GPU holds
    besides the allocated peak (:class:`DeviceOverheads`); ``*_pinned``: the host bytes as pinned buffers.
    """

    pp_rank: int
    params: int
    grads: int
    optimizer: float
    optimizer_offloaded: float
    activations: float
    activations_offloaded_peak: float
    in_flight: int
    transient: float = 0.0
    reserved: float = 0.0
    optimizer_offloaded_pinned: float = 0.0
    activations_offloaded_pinned_peak: float = 0.0

    @property
    def allocated(self) -> float:
        """The allocator's peak: state, activations and the short-lived buffer."""
        return self.params + self.grads + self.optimizer + self.activations + self.transient

    @property
    def total(self) -> float:
        return self.allocated + self.reserved

    @property
    def host(self) -> float:
        """Bytes this GPU keeps in host memory: offloaded optimizer states + offloaded activations at peak."""
        return self.optimizer_offloaded + self.activations_offloaded_peak

    @property
    def host_pinned(self) -> float:
        """:attr:`host` as pinned buffers hold it (power-of-two blocks, :mod:`k2.launcher.planning.host_pinned`)."""
        return self.optimizer_offloaded_pinned + self.activations_offloaded_pinned_peak

    def as_dict(self) -> dict[str, Any]:
        return {
            "pp_rank": self.pp_rank,
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "optimizer_offloaded_to_host": self.optimizer_offloaded,
            "activations": self.activations,
            "activations_offloaded_to_host_peak": self.activations_offloaded_peak,
            "microbatches_in_flight": self.in_flight,
            "transient": self.transient,
            "reserved": self.reserved,
            "allocated": self.allocated,
            "total": self.total,
            "host": self.host,
            "host_pinned": self.host_pinned,
        }


def gpu_memory(
    states: list[list[StateBytes]],
    acts: list[StageActivations],
    sim,
    dims,
    optimizer_offload_fraction: float = 0.0,
    overheads: DeviceOverheads | None = None,
) -> list[GpuMemory]:
    """Per PP rank, the fullest of its GPUs: states (:func:`k2.launcher.planning.memory.state_bytes`) +
    the activations the simulated pipeline schedule ``sim`` (:func:`k2.launcher.planning.pipeline_sim.simulate` run with
    ``activation_bytes`` = each stage's ``gpu`` bytes) holds at its peak + ``overheads`` (none: 0). The
    offloaded optimizer share of the pinned bytes is ``optimizer_offload_fraction`` of all of them."""

    # host bytes held over the same simulated timeline (from a forward's end to its backward's end)
    host = sim.peak_bytes([a.host for a in acts]) if any(a.host for a in acts) else None
    pinned = sim.peak_bytes([a.host_pinned for a in acts]) if any(a.host_pinned for a in acts) else None
    f = optimizer_offload_fraction
    out = []
    for r in range(dims.pp):
        worst = max(states[r], key=lambda x: x.params + x.grads + x.optimizer)
        staging = max(acts[v * dims.pp + r].offload_staging for v in range(dims.vpp))
        rerun = max(acts[v * dims.pp + r].recompute_working for v in range(dims.vpp))
        mem = GpuMemory(
            pp_rank=r,
            params=worst.params,
            grads=worst.grads,
            optimizer=worst.optimizer * (1.0 - f),
            optimizer_offloaded=worst.optimizer * f,
            activations=sim.peak_activation_bytes[r] + 2 * staging + rerun,
            activations_offloaded_peak=host[r] if host else 0.0,
            in_flight=sim.peak_in_flight[r],
            transient=overheads.transient if overheads else 0.0,
            optimizer_offloaded_pinned=worst.optimizer_pinned * f,
            activations_offloaded_pinned_peak=pinned[r] if pinned else 0.0,
        )
        out.append(
            mem if overheads is None else GpuMemory(**{**mem.__dict__, "reserved": overheads.reserved(mem.allocated)})
        )
    return out
