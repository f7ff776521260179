"""Typed schema of the Hydra config tree in ``recipes/``.

Every key a recipe or a command-line override may set is declared here, with its default. The composed
config is merged into these dataclasses by :func:`k2.config.load_config`, so an unknown key or a
value of the wrong type fails before any process group starts (DEVELOPERS.md, "bad input").

Model keys use megatron-core's ``TransformerConfig`` / ``MLATransformerConfig`` field names wherever one
exists, so a megatron user can read a recipe without a glossary. The few K2-specific keys that have no
megatron equivalent say so in their comment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from k2.config.choices import (
    AttentionBackend,
    CheckpointVerify,
    ConvertModelType,
    Fp8Recipe,
    LrStyle,
    MaxLogitKernel,
    MuonMatmulPrecision,
    MuonScaleMode,
    MuonZero1,
    Output,
    Precision,
    RopeType,
    RouterOptimizer,
    SpikeAction,
    WandbMode,
)
from k2.config.schema_launch import LaunchConfig, PrepareConfig, SubmitConfig, SweepConfig
from k2.config.schema_planning import ClusterConfig, PlanConfig, WhatIfConfig  # noqa: F401  (k2-plan's sections)


@dataclass
class ModelConfig:
    """K2 model family (docs/k2_reference.md, "Model"). Widths in elements, lengths in tokens."""

    name: str = "k2_tiny"
    num_layers: int = 4
    hidden_size: int = 128
    ffn_hidden_size: int = 384  # dense-layer SwiGLU width (K2: 18432)
    num_attention_heads: int = 4
    # K2/DeepSeek config name: the first k layers are dense, the rest MoE. Converted to megatron's
    # ``moe_layer_freq`` list ([0]*k + [1]*(num_layers-k)).
    first_k_dense_replace: int = 1
    # MLA (megatron MLATransformerConfig names)
    multi_latent_attention: bool = True
    q_lora_rank: int | None = 64
    kv_lora_rank: int = 32
    qk_head_dim: int = 32  # "nope" part of q/k per head
    qk_pos_emb_head_dim: int = 16  # rotary part of q/k per head
    v_head_dim: int = 32
    # MoE
    num_moe_experts: int | None = 8
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 64
    moe_shared_expert_intermediate_size: int | None = 64  # 1 shared expert of moe_ffn_hidden_size
    moe_router_score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    moe_router_bias_update_rate: float = 1.0e-3
    moe_router_topk_scaling_factor: float | None = 2.827
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_load_balancing_type: str = "seq_aux_loss"
    moe_aux_loss_coeff: float = 1.0e-4
    moe_router_dtype: str | None = "fp32"
    moe_token_dispatcher_type: str = "alltoall"
    # Vocabulary / positions
    vocab_size: int = 4096
    max_position_embeddings: int = 4096
    rope_type: RopeType = RopeType.rope  # rope while pretraining at 4K; yarn for the 128K extension
    rotary_base: float = 50000.0
    rotary_scaling_factor: float = 32.0  # YaRN factor (used when rope_type == "yarn")
    original_max_position_embeddings: int = 4096
    beta_fast: float = 1.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    # Norms / init / misc
    normalization: str = "RMSNorm"
    layernorm_epsilon: float = 1.0e-6
    init_method_std: float = 0.006
    share_embeddings_and_output_weights: bool = False
    # Dropout probabilities (megatron's hidden_dropout after attention and MLP, attention_dropout on the
    # attention probabilities). K2 and DeepSeek-V3 pretrain without dropout: 0.0 in both recipes.
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # Project-owned core attention: record the per-head max pre-softmax logit every forward
    # (needed by QK-Clip). On GPU this costs one extra no-grad QK^T pass per layer.
    record_max_logits: bool = True
    # Core attention backend (model/attention.py): auto = sdpa (fused SDPA, cuDNN first, + a chunked
    # max-logit pass) on CUDA, with or without Transformer Engine, eager on CPU; sdpa | eager | te force
    # one (sdpa also runs on CPU; te, TE's fused attention, only when set: it has not run here yet).
    attention_backend: AttentionBackend = AttentionBackend.auto
    # How the sdpa backend gets QK-Clip's per-head max logit: torch = a chunked q k^T pass in torch (scores
    # written to memory and read back); triton = one Triton kernel keeping only running maxima
    # (model/max_logit_kernel.py; CUDA; opt-in until measured on a GPU).
    max_logit_kernel: MaxLogitKernel = MaxLogitKernel.torch
    # Routed experts as grouped GEMMs (torch._grouped_mm, model/grouped_mlp.py) instead of megatron's
    # SequentialMLP loop; same parameters and checkpoints. null = auto: on with CUDA and bf16, off on CPU.
    # (megatron's field of the same name selects Transformer Engine's grouped experts; the K2 build
    # passes false to megatron and swaps in its own module.)
    moe_grouped_gemm: bool | None = None


@dataclass
class ParallelConfig:
    """Parallel layout. DP is derived: world_size / (tp * pp). EP is carved out of the DP ranks."""

    name: str = "single"
    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual stages per PP rank (None or 1 = no interleaving)
    ep: int = 1
    # megatron pipeline_model_parallel_layout string, e.g. "Et|(tt|)*30L" (E=embedding, t=layer,
    # L=loss, '|' separates virtual stages in order vpp_rank*pp + pp_rank). Mutually exclusive with
    # first/last_stage_layers.
    layout: str | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    use_distributed_optimizer: bool = True  # ZeRO-1 over DP


# Activation-memory sites (docs/k2_reference.md "Training system", "Activation memory"), config group ``memory``.
# Each name selects tensors that autograd saves for backward in every transformer layer; the model code
# that applies them is model/activation_memory.py. Names and the tensors they cover (shapes per microbatch, s =
# sequence length, b = micro_batch_size, h = hidden_size, t = tokens routed to an expert):
#
# memory.fp8_store: kept as FP8-E4M3 with one FP32 scale per 1 x 128 tile of the last dimension, turned
# back to the compute dtype when backward needs them (compute stays BF16/FP32, no FP8 GEMMs).
MEMORY_FP8_SITES = {
    "moe_fc1_input": "input of the routed experts' up-projection linear_fc1 [t, h] (the permuted tokens)",
    "swiglu_input": "linear_fc1 output fed into SwiGLU [.., 2 x ffn] (routed experts, shared expert, dense MLP)",
}
# memory.recompute: the output is not kept for backward but recomputed from the input during backward.
MEMORY_RECOMPUTE_SITES = {
    "layernorm": "input_layernorm and pre_mlp_layernorm (RMSNorm) outputs [s, b, h] (as megatron's 'layernorm')",
    "swiglu": "SwiGLU output [.., ffn] (routed experts, shared expert, dense MLP; megatron 'moe_act' "
    "covers only grouped-GEMM experts)",
    "mla_up_proj": "MLA up-projections, latent norms and RoPE: q, k, v [s, b, heads, dim] (megatron 'mla_up_proj')",
    "moe_down_proj": "routed experts' down-projection linear_fc2 output [t, h] (no megatron equivalent)",
    # megatron's module recompute (recompute_modules): k2-plan plans them; k2-train refuses them
    # (model/backends.py) until the K2 layers run megatron's checkpoints of these modules
    "core_attn": "core attention's saved tensors, its inputs q, k, v kept (megatron 'core_attn'; k2-plan only)",
    "mlp": "a dense layer's whole SwiGLU MLP, its input kept (megatron 'mlp'; k2-plan only)",
    "moe": "a MoE layer's router, all-to-alls, routed and shared experts, its input kept (megatron 'moe'; the "
    "all-to-alls re-run in backward; k2-plan only)",
    "layer": "the whole transformer layer: only its input [s, b, h] is kept (offload=attn_input moves it to "
    "host), the layer is re-run in backward (megatron's recompute_granularity=full, one layer at a "
    "time); the other sites then act only on what the layer input is",
}
#: the recompute sites k2-plan plans and k2-train does not run yet (it refuses them: model/backends.py)
PLANNED_ONLY_RECOMPUTE = ("core_attn", "mlp", "moe")
# memory.offload: moved to host memory in forward, brought back before their backward (GPU: side
# streams + pinned memory, overlapped with compute; CPU: a plain copy). Works with PP and VPP.
MEMORY_OFFLOAD_SITES = {
    "attn_input": "what the attention-side RMSNorm (input_layernorm) saves: the layer input [s, b, h]",
    "mla_up_proj": "what MLA's down/up projections and q/kv latent norms save: normed hidden states, "
    "compressed q and kv latents",
    "core_attn": "what core attention saves: q, k, v and the softmax probabilities [b, heads, s, s]",
    "attn_proj": "input of the attention output projection linear_proj [s, b, heads x v_head_dim]",
    "mlp_input": "what the MLP-side RMSNorm (pre_mlp_layernorm) saves: the residual stream [s, b, h]",
    "moe_fc1_input": "input of the routed experts' linear_fc1 [t, h]",
    "swiglu_input": "linear_fc1 output fed into SwiGLU (routed experts, shared expert, dense MLP)",
    "fc2_input": "SwiGLU output fed into linear_fc2 (routed experts, shared expert, dense MLP)",
}


@dataclass
class MemoryConfig:
    """Activation memory switches (docs/k2_reference.md "Training system"): lists of site names, see
    ``MEMORY_FP8_SITES``, ``MEMORY_RECOMPUTE_SITES``, ``MEMORY_OFFLOAD_SITES`` above. Empty = off. All
    three compose (an FP8-stored tensor can also be offloaded: its FP8 payload and scales move).
    K2: ``fp8_store=[moe_fc1_input, swiglu_input]``,
    ``recompute=[layernorm, swiglu, mla_up_proj, moe_down_proj]``, offload of the rest."""

    fp8_store: list[str] = field(default_factory=list)
    recompute: list[str] = field(default_factory=list)
    offload: list[str] = field(default_factory=list)


@dataclass
class DataConfig:
    """Training data. ``path`` is a megatron indexed-dataset prefix (``PREFIX.bin``/``PREFIX.idx``), a
    list of prefixes, or a blend ``[w1, prefix1, w2, prefix2, ...]``. ``None`` = the embedded stdlib
    corpus built by ``k2-data`` into ``cache_dir``."""

    name: str = "stdlib"
    path: Any | None = None
    valid_path: Any | None = None
    tokenizer: str | None = None  # a HF tokenizer.json; None = the one k2-data trained
    cache_dir: str = "data_cache"
    # k2-data settings for the embedded corpus
    vocab_size: int = 4096
    valid_fraction: float = 0.02
    split: str = "98,2,0"  # used only when valid_path is None and path is a user dataset
    num_workers: int = 0
    # megatron's shuffle seed of the documents and samples (train and validation); null = run.seed. A sweep
    # fixes it so that every cell reads the same data order and is evaluated on the same held-out tokens
    seed: int | None = None
    # index (and shuffle) at least this many training tokens per context length; null = what the schedule
    # trains there. megatron shuffles the samples over the whole index, so its size decides their order: a
    # sweep's trunk and its cooldown branches set the trunk's, so that they read the same samples
    index_tokens: int | None = None
    # k2-train reads every dataset's whole .bin/.idx before any rank starts and compares their xxh3-64
    # checksums with the k2-data manifest (the cost is printed); false = sizes and index headers only
    verify: bool = False


def _own(optimizer: str, default: Any) -> Any:
    """A setting of ``optim`` that belongs to ``optimizer`` alone, with its default
    (:func:`optimizer_settings` lists them)."""
    return field(default=default, metadata={"optimizer": optimizer})


def optimizer_settings(optimizer: str) -> tuple[str, ...]:
    """The ``optim`` keys that belong to ``optimizer`` (an ``optim.name``) alone, in declaration order:
    ``("muon_momentum", ..., "muon_zero1")`` for ``muonclip``, none for ``adamw``."""
    return tuple(f.name for f in fields(OptimConfig) if f.metadata.get("optimizer") == optimizer)


@dataclass
class OptimConfig:
    """Optimizer. ``name`` picks the Hydra choice (adamw now; muonclip in a later issue). The learning
    rate and weight decay of every step come from the ``schedule`` group (one source of truth)."""

    name: str = "adamw"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0
    # optim=muonclip (optim/, docs/optimizer.md): Muon for weight matrices, megatron
    # OptimizerConfig names, defaults = K2 (docs/k2_reference.md "Optimizer"). The settings of one optimizer
    # alone are declared with _own(<optimizer>, default): k2.optim.registry's spec of that optimizer reads
    # them from here (optimizer_settings), and the ones megatron's OptimizerConfig also has go to it by name.
    muon_momentum: float = _own("muonclip", 0.95)
    muon_nesterov: bool = _own("muonclip", True)
    muon_num_ns_steps: int = _own("muonclip", 5)  # Newton-Schulz iterations
    muon_coefficient_type: str = _own("muonclip", "simple")  # NS coefficients (3.4445, -4.7750, 2.0315)
    # update x sqrt(max(A, B)) for an A x B matrix ...
    muon_scale_mode: MuonScaleMode = _own("muonclip", MuonScaleMode.spectral)
    # ... x 0.2: update RMS ~ AdamW's (same lr and weight decay)
    muon_extra_scale_factor: float = _own("muonclip", 0.2)
    # medium = Newton-Schulz in bf16 (K2); highest = fp32
    muon_fp32_matmul_prec: MuonMatmulPrecision = _own("muonclip", MuonMatmulPrecision.medium)
    # Moonshot's parameter rules (Moonlight examples/toy_train.py: every parameter with ndim >= 2 except
    # the token embedding and the output head goes to Muon, and every parameter is decayed; "Muon is
    # Scalable", arXiv 2502.16982, appendix D: decaying the RMSNorm gamma matters for stability).
    # optimizer of the MoE router weight [experts, hidden] under optim=muonclip: muon (Moonlight, megatron's
    # default routing, Megatron-Bridge's Kimi-K2 recipe) | adamw
    router_optimizer: RouterOptimizer = _own("muonclip", RouterOptimizer.muon)
    # decoupled weight decay on every parameter, norm weights and biases included (Moonlight; K2's rule,
    # the muonclip recipe's default); false = megatron's default (no decay for 1-D tensors and biases),
    # the adamw recipe's (the CPU proxy's baseline)
    decay_all_params: bool = True
    # ZeRO-1 of the Muon matrices (with parallel.use_distributed_optimizer): byte_range = megatron's standard
    # byte-range distributed optimizer, unpadded, a matrix a shard boundary cuts gathered for Newton-Schulz
    # (Distributed Muon, "Muon is Scalable" section 2.3; optim/distributed_muon.py) | layer_wise =
    # megatron's layer-wise distributed optimizer (whole matrices bin-packed into padded DP shards)
    muon_zero1: MuonZero1 = _own("muonclip", MuonZero1.byte_range)
    # share of the optimizer states (FP32 master weights, AdamW moments, Muon momentum) kept in host memory
    # (pinned with CUDA) between optimizer steps, by k2-train and in k2-plan's figures (K2 offloads part of
    # them at 32 nodes; optim/offload.py). Needs the distributed optimizer (byte-range for MuonClip).
    offload_fraction: float = 0.0
    # QK-Clip (any optimizer): after each step, heads whose max pre-softmax logit S exceeds tau get their
    # q/k weights scaled so that S becomes tau (K2: 100); null = off (max logits are still logged).
    # megatron's equivalent: qk_clip + qk_clip_threshold.
    qk_clip_tau: float | None = None


@dataclass
class SpikeConfig:
    """Loss-spike guard (``train.spike.*``, launcher/training/spike.py, docs/fault_tolerance.md): a step whose
    loss or gradient norm exceeds mean + sigma x std of the last ``window`` accepted steps is a spike
    (OLMo-core's ``SkipStepOptimizer``: 128 steps, 6 sigma)."""

    window: int = 128  # accepted steps the mean and std are taken over (detection starts at half of it)
    sigma: float = 6.0  # standard deviations above the window's mean
    # log = a metrics.jsonl field and a log line, training unchanged (the default: the README main job has
    # 11-sigma gradient-norm outliers that recover by themselves) | skip = no update for that step (weights,
    # optimizer states, router expert bias as before it), its tokens count as consumed | stop = end the run
    # with the divergence exit status
    action: SpikeAction = SpikeAction.log
    # with action=skip: this many spikes in a row stop the run (the window no longer describes it)
    max_consecutive_skips: int = 10


@dataclass
class TrainConfig:
    """Train loop. The context length and the global batch (in tokens) come from the ``schedule`` group,
    per phase; the global batch in sequences is derived (``schedule.global_batch_tokens / seq_length``)."""

    iters: int | None = None  # cap on optimizer steps; null = run to the end of the schedule
    micro_batch_size: int = 2  # sequences per microbatch (a schedule phase may override it)
    precision: Precision = Precision.fp32
    # the GEMMs in FP8 through Transformer Engine's recipe of this scaling (megatron-core's fp8 = e4m3 and
    # fp8_recipe): blockwise | mxfp8 (config/choices.py Fp8Recipe); null = the GEMMs in train.precision (K2:
    # BF16). Needs train.precision=bf16, a CUDA device, Transformer Engine and sequential experts
    # (model/backends.py); k2-plan prices it on any machine (launcher/planning/hardware.py)
    fp8_recipe: Fp8Recipe | None = None
    eval_interval: int = 50
    eval_iters: int = 4
    log_interval: int = 10  # steps between log lines when not on a terminal
    progress: bool = True
    deterministic_init: bool = True  # layout-independent init (same weights for any PP/VPP/EP)
    # checkpoint every N optimizer steps (launcher/checkpointing/); null = only at the end of the run
    save_interval: int | None = None
    # on the first step of each phase, count the bytes the transformer layers keep for backward (the
    # saved-tensor meter, model/saved_tensors.py) -> saved_bytes_per_microbatch in metrics.jsonl (rank 0's
    # layers, device + host). Costs memory on that step (every counted storage is held to its end): off
    # for cluster runs; needs a memory.* switch on (no layer scopes otherwise)
    measure_saved_bytes: bool = False
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    report: bool = False  # at the end of the run, rank 0 does `k2-report <run.dir>` (PNGs + summary)


@dataclass
class PhaseMemoryConfig:
    """A schedule phase's ``memory.*`` overrides (``schedule.phases.<i>.memory``): site lists as in
    :class:`MemoryConfig`; null = the previous phase's."""

    fp8_store: list[str] | None = None
    recompute: list[str] | None = None
    offload: list[str] | None = None


@dataclass
class PhaseDataConfig:
    """The data of one schedule phase (``schedule.phases.<i>.data``), the ``data.path`` / ``data.valid_path``
    forms; null = the previous phase's (the first phase: ``data.*``). The tokenizer is ``data.tokenizer``."""

    path: Any | None = None  # a prefix, a list of prefixes or a blend [w1, prefix1, w2, prefix2, ...]
    valid_path: Any | None = None  # null = the previous phase's validation set


@dataclass
class PhaseConfig:
    """One phase of the training schedule (``schedules/wsd.py`` has the rules). Set exactly one length."""

    name: str = "phase"
    tokens: int | None = None  # length in tokens (0 = skipped)
    steps: int | None = None  # length in optimizer steps of schedule.global_batch_tokens (warmup)
    until_tokens: int | None = None  # end of the phase, in tokens from the start of training
    # constant | linear | cosine | exponential | minus_sqrt | continue (the previous rule goes on)
    lr_style: LrStyle = LrStyle.constant
    lr_start: float | None = None  # LR at the start; null = the previous phase's end LR
    lr_end: float | None = None  # LR at the end; null = lr_start (constant)
    seq_length: int | None = None  # context length in tokens; null = the previous phase's
    rope_type: RopeType | None = None  # rope | yarn; null = the previous phase's (first: model.rope_type)
    micro_batch_size: int | None = None  # sequences; null = the previous phase's (first: train.*)
    # activation memory from this phase on: memory.fp8_store / recompute / offload (site lists, as in the
    # memory group); a key left null = the previous phase's (first: the memory group's)
    memory: PhaseMemoryConfig = field(default_factory=lambda: PhaseMemoryConfig())
    # this phase's data blend (and validation set); null = the previous phase's (first: data.path)
    data: PhaseDataConfig = field(default_factory=PhaseDataConfig)


@dataclass
class ScheduleConfig:
    """Training schedule in tokens: learning rate, context length, batch (docs/k2_reference.md "Schedule")."""

    name: str = "none"
    global_batch_tokens: int = 2048  # tokens per optimizer step, the same in every phase
    weight_decay: float = 0.1  # decoupled weight decay, every step (x each param group's wd_mult)
    phases: list[PhaseConfig] = field(default_factory=list)


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: str = "k2-launcher"
    entity: str | None = None
    name: str | None = None
    group: str | None = None  # wandb run group (a sweep's points share one: launcher/tools/sweep.py)


@dataclass
class RunConfig:
    dir: str = "runs/default"  # k2-train in a run dir with a checkpoint resumes from it (see `resume`)
    seed: int = 1234
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # wall-clock budget of this process in minutes: at the first step boundary past it, every rank
    # saves a checkpoint and exits with the requeue code (42), as on SIGTERM/SIGUSR1; null = none
    max_minutes: float | None = None
    # hang watchdog (launcher/training/watchdog.py, docs/fault_tolerance.md): seconds a step, evaluation or
    # save may make no progress before the job is stopped with the rank(s) named, every rank's stacks in
    # <run.dir>/hang/ and exit 42 (requeue); null = 10x the longest such point so far, at least 120 s
    hang_timeout_s: float | None = None
    # the same for the start-up (process groups, build, checkpoint load) and the first step, evaluation
    # and save of a launch (compilation, caches, no measured time yet)
    hang_startup_timeout_s: float = 1800.0
    # deterministic GPU kernels where torch has them (warn_only: an op without one warns), no cuDNN
    # autotuning, CUBLAS_WORKSPACE_CONFIG=:4096:8 (launcher/training/cuda_env.py); CPU runs are anyway
    deterministic: bool = False


@dataclass
class CheckpointConfig:
    """Checkpoint retention and format (``launcher/checkpointing/``). When to save: ``train.save_interval``,
    at the end of the run, and on preemption."""

    keep_last: int = 2  # newest complete checkpoints kept (the one `latest` names is always kept)
    keep_every: int | None = None  # also keep every checkpoint whose step is a multiple of this
    # also save at these steps and keep those checkpoints (a sweep's trunk: its branch points)
    save_steps: list[int] = field(default_factory=list)
    save_at_end: bool = True  # save when the run ends (train.iters or the end of the schedule)
    # what resume checks against the checkpoint's manifest before loading it: "checksum" (every file's
    # size and xxh3-64 checksum, read in parallel by the ranks), "size" (a stat per file), "none"
    verify: CheckpointVerify = CheckpointVerify.checksum
    # at the end of the run, also export the last checkpoint as a Hugging Face directory
    # <run.dir>/hf (k2-convert export; launcher/hf/): config.json, safetensors shards, tokenizer
    export_hf: bool = False
    # write the tensors in a forked background writer while training goes on (megatron-core's async
    # dist-checkpointing); the checkpoint is committed at a later step boundary (docs/checkpoints.md).
    # On by default: k2-bench bench=checkpoint measured the loop's wait per save at ~0.11x of a
    # synchronous save; k2-plan counts the copy-on-write snapshot (up to one more copy of the
    # host-resident state) in host memory
    async_save: bool = True


@dataclass
class ConvertConfig:
    """``k2-convert`` (launcher/hf/): Hugging Face DeepSeek-V3 / Kimi K2 checkpoints in and out. On the
    command line ``hf=``, ``out=`` and ``checkpoint=`` are short for ``convert.hf=`` ..."""

    hf: str | None = None  # import: the HF directory (config.json + safetensors index and shards)
    checkpoint: str | None = None  # export: a checkpoint, a checkpoints/ dir or a run dir (its latest)
    out: str | None = None  # export: the HF directory to create (must not exist)
    # config.json's model_type: deepseek_v3 (loads in transformers without custom code) | kimi_k2 (K2's
    # own label; the pinned transformers does not register it)
    model_type: ConvertModelType = ConvertModelType.deepseek_v3
    shard_bytes: int = 2147483648  # bytes per safetensors shard (export) / at most per .distcp file (import)
    dtype: Precision | None = None  # export; null = the checkpoint's dtype


@dataclass
class PipelineConfig:
    """Pipeline schedule (``schedules/pipeline.py``, ``model/wgrad.py``; docs/k2_reference.md "Training system")."""

    # K2's interleaved 1F1B with decoupled weight gradients: each linear layer's backward computes the
    # input gradient now and queues the weight gradient, which runs after the send of the input gradient
    # to the previous stage is posted and before it is waited on (megatron: delay_wgrad_compute, TE only)
    decouple_wgrad: bool = False
    # K2's communication overlap (megatron-core's overlap_moe_expert_parallel_comm, combined 1F1B): in
    # each 1F1B step one microbatch's MoE dispatch / combine all-to-alls are in flight while another
    # microbatch computes, with one extra warm-up microbatch per pipeline rank (schedules/ep_overlap.py)
    ep_overlap: bool = False
    # directory for an event trace of the schedule: one rank<R>.jsonl per rank (F, B, W, send, recv,
    # wait per microbatch; `python -m schedules.pipeline DIR out.png` draws a step); null = no trace
    trace: str | None = None


@dataclass
class BenchConfig:
    name: str = "none"
    options: Any | None = None


@dataclass
class K2Config:
    """Root of the config tree (``recipes/config.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # resume (recipes/resume/: auto | never): `mode` auto = resume from <run.dir>/checkpoints/latest when
    # there is one; never = refuse a non-empty run.dir. `resume.from=PATH` (a checkpoint, a checkpoints/
    # directory or a run dir) resumes from there. `resume.force=true` accepts changed model / schedule /
    # optimizer / data settings. `resume.branch_from=PATH`: while run.dir has no checkpoint of its own, start
    # from PATH's as a branch whose schedule may differ after that step (a WSD cooldown branch,
    # launcher/checkpointing/branch.py). A plain mapping: `from` is a Python keyword (checked in
    # k2.config.validate.resume_settings).
    resume: dict[str, Any] = field(
        default_factory=lambda: {"mode": "auto", "from": None, "force": False, "branch_from": None}
    )
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    submit: SubmitConfig = field(default_factory=SubmitConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    output: Output = Output.text  # k2-plan, k2-bench
    plot: str | None = None  # k2-plan: write a PNG of the per-rank pipeline timeline to this path
    plot_schedule: str | None = None  # k2-plan: write a PNG of the schedule (LR, context over tokens) here
