"""The hardware profile: one device type and its node, the section ``k2-plan``'s step-time model and the
trainer's MFU read (``plan.hardware`` names it).

A profile is a YAML file: one of ``recipes/hardware/<name>.yaml`` (``h800``, ``h100``, ``h200``, ``b200``,
``b300``, ``gb200_nvl72``, ``gb300_nvl72``: every number with its source on its line) or a file ``k2-bench
bench=hardware`` wrote on the machine it measured. :func:`k2.config.hardware.load_hardware_profile` reads it through
``OmegaConf.structured(HardwareProfileConfig)``: an unknown key, a value of the wrong type or a missing
required number is one :class:`k2.config.ConfigError` naming the file and the key.

Units: TFLOP/s (1e12 FLOP/s) for compute rates, GB/s (1e9 bytes/s, per GPU and per direction) for
bandwidths, microseconds for latencies and per-operator costs, GiB for memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from k2.config.choices import Choice

__all__ = ["CommStream", "HardwareProfileConfig", "REQUIRED_POSITIVE"]


class CommStream(Choice):
    """``comm_stream``: how the EP overlap's communication stream runs beside the compute
    (``k2.launcher.planning.ep_overlap``): ``device``, a second CUDA stream; ``host_thread``, a thread of the
    host process that also runs the compute (``k2.parallel.comm_stream``, k2-train on CPU)."""

    device = "device"
    host_thread = "host_thread"


@dataclass
class HardwareProfileConfig:
    """One device type and its node (the profile file's keys, same names).

    ``name``, ``peak_fp8_tflops`` and ``gemm_fp8_tflops`` are filled in when the file leaves them out
    (:func:`k2.config.hardware.load_hardware_profile`): the file's stem, 2 x the BF16 figure.
    """

    name: str | None = None  # the profile's name; null = the file's stem
    gpu: str = ""  # the device it describes
    # devices one host carries: the host's memory and CPUs, a Slurm node (an HGX / DGX node: 8; a GB200 /
    # GB300 compute tray: 4; on a CPU machine the ranks)
    gpus_per_host: int = 8
    # devices joined by NVLink, where an all-to-all or a collective stays on NVLink (an NVL72 rack: 72);
    # null = one host's
    nvlink_domain_gpus: int | None = None
    # datasheet dense peaks, TFLOP/s (MFU is reported against the BF16 one); FP8 null = 2 x BF16
    peak_bf16_tflops: float = MISSING
    peak_fp8_tflops: float | None = None
    # achieved GEMM ceilings at large shapes, TFLOP/s; FP8 null = 2 x BF16; FP32 null = BF16 / 2 (Hopper's
    # TF32-less FP32 path is not modelled); grouped expert GEMMs null = the dense ceiling
    gemm_bf16_tflops: float = MISSING
    gemm_fp8_tflops: float | None = None
    gemm_fp32_tflops: float | None = None
    gemm_grouped_bf16_tflops: float | None = None
    gemm_grouped_fp8_tflops: float | None = None
    # a CPU profile's large-square GEMM rate, TFLOP/s (k2-bench bench=hardware records it; the model
    # uses gemm_bf16_tflops, the rate at the job's own shapes)
    gemm_ceiling_tflops: float | None = None
    # the least share of the compute stream the non-GEMM kernels take (0 = bytes at bandwidth alone)
    nongemm_share: float = 0.0
    attention_tflops: float = MISSING  # achieved core-attention rate (forward and backward), TFLOP/s
    memory_gbps: float = MISSING  # memory peak, GB/s
    memory_efficiency: float = 1.0  # the fraction of memory_gbps element-wise kernels reach
    # time one kernel adds to the stream beyond its roofline time, us (a measured CPU profile: the cost of
    # one operator of a transformer layer)
    kernel_launch_us: float = 0.0
    gemm_tile: int = 128  # GEMM output tile edge for tile quantization (1: off)
    compute_units: int | None = 132  # SMs for wave quantization (null: off)
    # intra-node link peak per direction and what an all-to-all and a ring collective achieve, GB/s per GPU
    nvlink_gbps: float = MISSING
    nvlink_alltoall_gbps: float = MISSING
    nvlink_collective_gbps: float = MISSING
    # the same across NVLink domains (per GPU NIC), GB/s; the all-to-all rates are NCCL's (megatron's
    # ``alltoall`` dispatcher)
    network_gbps: float = MISSING
    network_alltoall_gbps: float = MISSING
    network_collective_gbps: float = MISSING
    # DeepEP's all-to-all rates inside and across NVLink domains (megatron's ``flex`` dispatcher, the
    # ``plan.what_if.deepep`` setting), GB/s; null = NCCL's
    nvlink_alltoall_deepep_gbps: float | None = None
    network_alltoall_deepep_gbps: float | None = None
    # compute units (SMs) an all-to-all kernel occupies while it runs beside compute: NCCL's (one CTA per
    # p2p channel) and DeepEP's; the compute beside an overlapped all-to-all keeps the rest of
    # ``compute_units`` (null: none taken, e.g. a CPU, whose share is ``alltoall_host_cpu_share``)
    alltoall_comm_units: int | None = None
    deepep_comm_units: int | None = None
    network_latency_us: float = 0.0  # per message across nodes (also charged per point-to-point send), us
    intra_latency_us: float = 0.0  # per message inside a node (a measured CPU profile: gloo's), us
    # per message across nodes while an all-to-all is on the same link, us: a small collective (the MoE
    # dispatcher's token-count all-gather) queues behind the all-to-all's bytes in front of the link
    # (k2-bench bench=ep_overlap measures it on its shaped link); null: network_latency_us
    network_loaded_latency_us: float | None = None
    host_gbps: float = MISSING  # device <-> host copies per GPU (offload), GB/s
    # per part (embedding, loss, optimizer) the cost of one of its operators where measured apart, us; a
    # part not named costs kernel_launch_us
    operator_us: dict[str, float] = field(default_factory=dict)
    # the training schedule's own work beyond the model's operators, per microbatch and virtual stage and
    # per step, us (a measured CPU profile; GPU profiles: 0, hidden behind the kernels)
    microbatch_overhead_us: float = 0.0
    step_overhead_us: float = 0.0
    # a GPU host's own time per operator of megatron-core's layer code before its CUDA launch call (Python,
    # dispatcher, autograd, allocator), forward and backward, us: k2-plan's ``host`` term, exposed where a
    # stretch between two host waits issues more than the GPU runs (k2.launcher.planning.host_bound;
    # k2-bench bench=host_cost measures it); 0: no host term (a CPU profile, whose operators run in series)
    host_forward_operator_us: float = 0.0
    host_backward_operator_us: float = 0.0
    comm_stream: CommStream = CommStream.device
    # with comm_stream host_thread: the share of one core (0 <= share < 1) that the host's own work on an
    # all-to-all (gloo's threads, the kernel's TCP and shaping) takes while the all-to-all is on the wire;
    # a compute node running beside it is slower by as much (k2-bench bench=ep_overlap measures it on its
    # link: the process's CPU seconds over the wall seconds of back-to-back all-to-alls of the run's size)
    alltoall_host_cpu_share: float = 0.0
    # with comm_stream host_thread: how much longer (>= 1) an all-to-all takes on the wire while the host
    # computes beside it, its communication threads and the kernel's TCP getting less of the CPU (k2-bench
    # bench=ep_overlap measures it on its link: back-to-back all-to-alls from the communication thread with
    # and without a GEMM loop on the main thread)
    alltoall_beside_compute_slowdown: float = 1.0
    # per dispatch or combine of an EP group, us: how long it waits, beyond its own rank's issue, for the last
    # rank of the group to issue it (an all-to-all starts when every rank has called it; the ranks' compute
    # between two all-to-alls differs: the tokens routed to each rank's experts, the host's noise); with or
    # without the overlap (k2-bench bench=ep_overlap measures it on its unshaped calibration run's trace);
    # 0: the ranks issue each all-to-all together
    alltoall_peer_wait_us: float = 0.0
    # memory of one device, GiB: the capacity k2-plan plans with unless cluster.gpu_memory_gib is set
    # (null: not given, e.g. a CPU profile)
    gpu_memory_gib: float | None = None
    # the train.fp8_recipe values its tensor cores run (Hopper: blockwise; Blackwell: blockwise, mxfp8 --
    # MXFP8's microscaled GEMMs are Blackwell's, Transformer Engine's MXFP8BlockScaling recipe); null = any
    fp8_recipes: list[str] | None = None
    # host memory of one host (``gpus_per_host`` devices), GiB: what offloaded states and an asynchronous
    # checkpoint's staged copy may use unless cluster.host_memory_gib is set (null: not given)
    host_memory_gib: float | None = None
    sources: dict[str, Any] = field(default_factory=dict)  # where the numbers come from


#: the numbers every profile gives, each > 0
REQUIRED_POSITIVE = (
    "peak_bf16_tflops",
    "gemm_bf16_tflops",
    "attention_tflops",
    "memory_gbps",
    "nvlink_gbps",
    "nvlink_alltoall_gbps",
    "nvlink_collective_gbps",
    "network_gbps",
    "network_alltoall_gbps",
    "network_collective_gbps",
    "host_gbps",
)


#: the optional numbers a profile may give, each > 0 where given (null: not given)
OPTIONAL_POSITIVE = (
    "nvlink_domain_gpus",
    "nvlink_alltoall_deepep_gbps",
    "network_alltoall_deepep_gbps",
    "gpu_memory_gib",
    "host_memory_gib",
)
