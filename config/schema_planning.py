"""The ``cluster`` and ``plan`` sections of the config schema (:mod:`k2.config.schema`): the target cluster
``k2-plan`` plans for (and the peak the trainer's MFU is measured against) and ``k2-plan``'s own settings,
its step-time model's hardware profile and what-if settings included (docs/performance_model.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ClusterConfig:
    """Target cluster for ``k2-plan`` (and the peak the trainer's MFU is measured against)."""

    nodes: int = 1
    gpus_per_node: int = 8
    # where an NVLink domain spans hosts (an NVL72 rack: 18 trays of 4 GPUs), the job's consecutive nodes that
    # share one domain: Slurm's --segment under its topology/block plugin. null = the whole job in one rack
    # when it fits one, else 16 (64 GPUs per rack: NVIDIA's recommended segment for jobs of 128 GPUs and
    # more, e.g. MoE training; "Achieving Peak System and Workload Efficiency on NVIDIA GB200 NVL72 with Slurm
    # Block Scheduling", NVIDIA technical blog). k2-plan places PP, EP and DP groups by it: a group that
    # straddles two segments crosses the network. Not used for profiles whose domain is one host
    segment_nodes: int | None = None
    # memory of one GPU, GiB; null = the one plan.hardware's profile names (h800 / h100: 80, h200: 141), 80
    # for a profile without one (e.g. a CPU machine's, measured by k2-bench bench=hardware)
    gpu_memory_gib: float | None = None
    # host (CPU) memory of one node, GiB: what offloaded activations and optimizer states may use; null = the
    # host memory of plan.hardware's profile per GPU x gpus_per_node (h800 / h100 / h200 / b200 / b300: 2,048
    # per 8-GPU host; an NVL72 compute tray: 960 per 4 GPUs), 2,048 for a profile without one
    host_memory_gib: float | None = None
    # dense BF16 peak of one GPU in TFLOP/s that MFU (k2-train, k2-plan) and k2-plan's FLOPs-only estimate use;
    # null = peak_bf16_tflops of plan.hardware's profile (h800 / h100 / h200: 989.4); a number overrides it
    peak_tflops: float | None = None
    # on CPU, MFU is against this GEMM peak of one rank in TFLOP/s (e.g. a measured torch.mm rate);
    # null = no MFU on CPU (mfu null in metrics.jsonl; a GPU's peak would make it meaningless)
    cpu_peak_tflops: float | None = None
    # k2-plan's checkpoint figures (launcher/planning/checkpoint.py, docs/performance_model.md): GB/s one node
    # writes to the shared file system. 10 = a 100 Gb/s storage NIC per node (DGX H100 reference: 2 x 200 Gb/s
    # storage links; parallel file systems deliver 1-10 GB/s per client node)
    checkpoint_write_gbps: float = 10.0
    # mean time between failures of the whole job, hours; null = Llama 3's rate for this many GPUs: 419
    # unexpected interruptions in 54 days on 16,384 H100 (arXiv 2407.21783 section 3.3.4), i.e. 3.09 h x
    # 16,384 / GPUs (198 h on 256 GPUs)
    mtbf_hours: float | None = None


@dataclass
class WhatIfConfig:
    """``plan.what_if.*``: labelled settings of published runs for ``k2-plan``'s comparisons; k2-train has
    none of them (launcher/planning/step_time.py)."""

    # FSDP2 under torch's pipelining (NeMo AutoModel): per pipeline flush the gradients are reduce-scattered
    # (exposed) and the parameters gathered again (overlapped but for the first layer's)
    fsdp: bool = False
    dualpipe: bool = False  # DeepSeek's DualPipe: EP all-to-all hidden, 20 of 132 SMs for communication
    # megatron's flex dispatcher with DeepEP: DeepEP's all-to-all rates and SMs (the profile's *_deepep_*
    # figures), an FP8 payload with train.fp8_recipe, one network copy per remote node
    deepep: bool = False
    node_limit: int | None = None  # node-limited routing: a token goes to at most this many nodes
    # gradient accumulation over this many pipeline schedules per step, each a full flush (fill and drain)
    # of num_microbatches / pipeline_flushes microbatches (torch pipelining's schedule.step() per local batch)
    pipeline_flushes: int = 1
    # multi-token-prediction modules on the stage holding the loss (DeepSeek-V3, arXiv 2412.19437 section
    # 2.2: a [2h -> h] projection, one transformer block, the shared output head again, per token)
    mtp_layers: int = 0
    # full-iteration CUDA graphs (megatron's cuda_graph_impl local / full_iteration): the step replays
    # without the host issuing its operators, so k2-plan's host term is 0
    cuda_graphs: bool = False


@dataclass
class GpuOverheadsConfig:
    """``plan.gpu_overheads.*``: GPU memory that is neither training state nor saved activations
    (launcher/planning/device_overheads.py). Estimates until a GPU measures them: ``benchmarks/gpu_session.sh``
    reports the CUDA context and the reserved-over-allocated ratio of one GPU."""

    # the CUDA context and loaded kernels (torch, cuBLAS, cuDNN modules; lazy loading, CUDA 12+): outside
    # torch's allocator, but out of the same GPU memory. ~0.5 GiB is what one process's context takes on
    # Hopper with CUDA_MODULE_LOADING=LAZY (torch's default since CUDA 11.7)
    cuda_context_gib: float = 0.5
    # buffers of one NCCL communicator that carries traffic (the run's default group, DP, EP, expert-DP,
    # PP, embedding, model-parallel: launcher/planning/device_overheads.py counts them): NCCL allocates
    # NCCL_BUFFSIZE (4 MiB) of Simple-protocol buffer, plus LL / LL128 buffers, per channel and
    # connection (NCCL environment-variable docs); tens of channels -> a few hundred MiB
    nccl_gib_per_communicator: float = 0.25
    # cuBLAS / cuBLASLt workspaces (torch: 32 MiB per handle and stream on Hopper) and cuDNN attention's
    workspace_gib: float = 0.25
    # memory the caching allocator reserves beyond what is allocated at the peak, as a fraction of it,
    # with launch.cuda_alloc_conf's expandable_segments:True (segments grow in place instead of leaving
    # unusable gaps: PyTorch "CUDA semantics", memory management)
    fragmentation: float = 0.05


@dataclass
class PlanConfig:
    """``k2-plan`` settings (launcher/planning/)."""

    query_tokens: Any | None = None  # list of token counts -> "lr_at_tokens" in the JSON
    search: bool = False  # list the valid PP/VPP/EP layouts of the cluster, ranked by estimated step time
    step_time_s: float | None = None  # a measured step time (s) -> MFU against cluster.peak_tflops
    # the FLOPs-only estimate k2-plan reported before its performance model (step_time_s_flops_only): a
    # stage's model FLOPs at this fraction of cluster.peak_tflops, communication assumed hidden
    compute_efficiency: float = 0.5
    # hardware profile of the step-time model (launcher/planning/step_time.py): a name in
    # recipes/hardware/ (h800 | h100 | h200) or the path of a YAML file k2-bench bench=hardware wrote
    hardware: str = "h800"
    # settings of published runs that k2-train does not have, for comparisons only (docs/performance_model.md)
    what_if: WhatIfConfig = field(default_factory=lambda: WhatIfConfig())
    # compare the step-time model with published runs (recipes/published/runs.yaml): a run's name or "all"
    published: str | None = None
    # GPU memory besides training state and saved activations (launcher/planning/device_overheads.py)
    gpu_overheads: GpuOverheadsConfig = field(default_factory=lambda: GpuOverheadsConfig())
