"""Build the K2 model (MLA + MoE) on megatron-core from the Hydra config.

Data flow: ``cfg.model`` + ``ParallelDims`` -> :func:`transformer_config` (megatron
``MLATransformerConfig``) -> :func:`decoder_block_spec` (megatron's local GPT layer specs with our
core attention and router swapped in) -> :func:`build_model_chunks` (one ``GPTModel`` per virtual
pipeline stage of this rank).

Structure (docs/k2_reference.md, "Model"): ``first_k_dense_replace`` dense SwiGLU layers, then MoE layers with
``num_moe_experts`` routed experts (top-``moe_router_topk``), one shared expert, sigmoid router with
expert-bias balancing and routed scaling factor, a small sequence-level aux loss; MLA attention with
``q_lora_rank``/``kv_lora_rank``; RMSNorm; untied embedding and output head.
"""

from __future__ import annotations

import copy
import dataclasses
import zlib
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from k2.model.activation_memory import MemoryOptions, megatron_recompute_fields
from k2.model.activation_memory import install as install_memory
from k2.model.attention import K2CoreAttention, te_core_attention_class
from k2.model.backends import resolve_attention_backend, resolve_grouped_experts
from k2.model.fp8 import fp8_fields, swap_linears, te_linear_classes
from k2.model.grouped_mlp import K2GroupedMLP
from k2.model.mlp import K2MLP, K2SequentialMLP, build_k2_shared_experts
from k2.model.recompute import K2MLASelfAttention, K2TransformerLayer
from k2.model.rope import rope_fields
from k2.model.router import K2Router

if TYPE_CHECKING:
    from k2.config.schema import K2Config, ModelConfig
    from k2.parallel.dims import ParallelDims

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def moe_layer_pattern(model_cfg: ModelConfig) -> list[int]:
    """megatron ``moe_layer_freq`` list: 0 = dense layer, 1 = MoE layer, one entry per layer.

    Raises:
        ValueError: ``k2.model.first_k_dense_replace`` outside ``[0, num_layers]``.
    """
    k, n = int(model_cfg.first_k_dense_replace), int(model_cfg.num_layers)
    if not 0 <= k <= n:
        raise ValueError(f"model.first_k_dense_replace={k} must be in [0, model.num_layers={n}]")
    if not model_cfg.num_moe_experts:
        return [0] * n
    return [0] * k + [1] * (n - k)


def _moe_fields(m: ModelConfig) -> dict:
    """The MoE settings of megatron's ``TransformerConfig`` from ``model.*`` (grouped GEMM and the fused
    permute/router kernels off here: ``k2.model.grouped_mlp`` and plain torch)."""
    return dict(
        num_moe_experts=m.num_moe_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_layer_freq=moe_layer_pattern(m),
        moe_router_score_function=m.moe_router_score_function,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_router_num_groups=m.moe_router_num_groups,
        moe_router_group_topk=m.moe_router_group_topk,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_router_dtype=m.moe_router_dtype,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def _parallel_fields(dims: ParallelDims) -> dict:
    """The parallel layout's settings of megatron's ``TransformerConfig`` (TP, PP, VPP, EP, the layer layout) and
    the pipeline's p2p settings."""
    return dict(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        expert_model_parallel_size=dims.ep,
        pipeline_model_parallel_layout=dims.megatron_layout,
        num_layers_in_first_pipeline_stage=dims.first_stage_layers,
        num_layers_in_last_pipeline_stage=dims.last_stage_layers,
        sequence_parallel=False,
        # Interleaved 1F1B: overlapped, unbatched p2p (as Megatron-LM's training defaults). With PP=2
        # the previous and next stage are the same rank, and megatron's *batched* p2p posts
        # [send_prev(grad), send_next(activation)] on one side against [recv_prev(activation),
        # recv_next(grad)] on the other; a backend that matches a peer's messages in posting order
        # (gloo) then swaps activations and gradients of equal shape silently. The unbatched path
        # splits the two directions over two communicators (megatron p2p_communication._p2p_ops).
        overlap_p2p_comm=dims.vpp > 1,
        batch_p2p_comm=dims.vpp <= 1,
        # a stage's output is freed once sent (its grad_fn is all the backward needs), as Megatron-LM's
        # training sets it: the schedule does not hold one [s, b, h] per microbatch in flight
        deallocate_pipeline_outputs=True,
    )


def transformer_config(cfg: K2Config, dims, rope_type: str | None = None):
    """megatron ``MLATransformerConfig`` for ``cfg.model`` under the parallel layout ``dims``.

    Args:
        cfg: the composed config (``model``, ``train`` sections used).
        dims: :class:`k2.parallel.dims.ParallelDims`.
        rope_type: ``rope`` | ``yarn``; None = ``k2.model.rope_type`` (the trainer passes its first
            schedule phase's).

    Returns:
        ``megatron.core.transformer.transformer_config.MLATransformerConfig``.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    m, t = cfg.model, cfg.train
    dtype = _DTYPES[t.precision]
    kw = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        qk_layernorm=True,  # MLA: RMSNorm on the compressed q and kv latents (DeepSeek-V3/K2)
        normalization=m.normalization,
        layernorm_epsilon=m.layernorm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        **rope_fields(m, rope_type or m.rope_type),
        **_parallel_fields(dims),
        # precision
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # loss: sum over tokens, normalised by the global token count (exact under any PP/DP/microbatch)
        calculate_per_token_loss=True,
        # fusions that need apex/TE or CUDA kernels: off (the compute path is plain torch)
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Transformer Engine's fused attention returns the per-head max logits (QK-Clip) only when asked
        log_max_attention_logit=resolve_attention_backend(m.attention_backend) == "te",
        # activation memory (model/activation_memory.py): megatron's own selective recompute of layernorm / mla_up_proj
        **megatron_recompute_fields(MemoryOptions.from_config(cfg)),
        **fp8_fields(t.fp8_recipe, moe=bool(m.num_moe_experts)),
    )
    if m.num_moe_experts:
        kw.update(_moe_fields(m))
    tcfg = MLATransformerConfig(**kw)
    if m.num_moe_experts and cfg.pipeline.ep_overlap:
        enable_ep_overlap(tcfg, torch.cuda.is_available())
    return tcfg


def enable_ep_overlap(tcfg, cuda: bool) -> None:
    """Turn on megatron-core's combined-1F1B EP overlap (``overlap_moe_expert_parallel_comm``; config
    ``pipeline.ep_overlap``, ``k2.schedules.ep_overlap``) in a built ``TransformerConfig``.

    Set after ``__post_init__`` because megatron asserts bf16 there, and the CPU runs are fp32: nothing
    in the schedule depends on the dtype (on GPUs megatron's bf16 rule is kept, below). Its other
    asserted rules are ``k2.config.validate.check_ep_overlap``'s, checked when the config is loaded.

    Raises:
        ValueError: a GPU run in fp32.
    """
    if cuda and not tcfg.bf16:
        raise ValueError(
            "pipeline.ep_overlap=true on GPUs needs train.precision=bf16 (megatron-core's "
            "combined-1F1B rule); allowed: train.precision=bf16, or pipeline.ep_overlap=false"
        )
    tcfg.overlap_moe_expert_parallel_comm = True


def _swap_submodules(
    layer_spec,
    record_max_logits: bool,
    attention_backend: str = "eager",
    grouped_experts: bool = False,
    max_logit_kernel: str = "torch",
):
    """Copy of a megatron local layer spec with K2's modules swapped in: K2CoreAttention (its
    ``attention_backend``: ``sdpa`` | ``eager``; ``te``: the Transformer Engine adapter; the sdpa
    backend's ``max_logit_kernel``: ``torch`` | ``triton``,
    :func:`k2.model.attention.te_core_attention_class`), K2Router, the K2 MLPs (``model/mlp.py``: megatron's
    MLP / SequentialMLP / SharedExpertMLP with the activation memory switches; routed experts as
    :class:`k2.model.grouped_mlp.K2GroupedMLP` with ``grouped_experts``) and megatron's TransformerLayer /
    MLASelfAttention with our recompute checkpoint (``model/recompute.py``).

    megatron's ``moe_grouped_gemm`` stays False in the ``TransformerConfig``: in megatron-core 0.19.2 it
    selects Transformer Engine's grouped experts; our grouped module is chosen here instead."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    spec = copy.deepcopy(layer_spec)
    # megatron's layer / MLA classes with our output-discarding checkpoint (model/recompute.py)
    if spec.module is not TransformerLayer or spec.submodules.self_attention.module is not MLASelfAttention:
        raise ValueError(f"unexpected layer spec: {spec.module}, {spec.submodules.self_attention.module}")
    spec.module = K2TransformerLayer
    spec.submodules.self_attention.module = K2MLASelfAttention
    attn = spec.submodules.self_attention.submodules
    core = te_core_attention_class() if attention_backend == "te" else K2CoreAttention
    attn.core_attention = ModuleSpec(
        module=core,
        params={
            "record_max_logits": record_max_logits,
            "backend": attention_backend,
            **({"max_logit_kernel": max_logit_kernel} if core is K2CoreAttention else {}),
        },
    )
    mlp = spec.submodules.mlp
    if isinstance(mlp, partial) and "submodules" in mlp.keywords and hasattr(mlp.keywords["submodules"], "router"):
        sub = mlp.keywords["submodules"]
        experts, shared = sub.experts, sub.shared_experts
        if not (isinstance(experts, partial) and experts.func is SequentialMLP):
            raise ValueError(f"expected megatron's local SequentialMLP experts in the spec, got {experts}")
        moe_sub = dataclasses.replace(
            sub,
            router=K2Router,
            experts=partial(K2GroupedMLP if grouped_experts else K2SequentialMLP, *experts.args, **experts.keywords),
            shared_experts=(
                None if shared is None else partial(build_k2_shared_experts, *shared.args, **shared.keywords)
            ),
        )
        spec.submodules.mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": moe_sub})
    elif isinstance(mlp, partial) and getattr(mlp.func, "__self__", None) is MLP:  # MLP.as_mlp_submodule
        spec.submodules.mlp = partial(K2MLP.as_mlp_submodule, *mlp.args, **mlp.keywords)
    else:
        raise ValueError(f"unexpected MLP in megatron's local layer spec: {mlp}")
    return spec


def decoder_block_spec(
    tcfg,
    vp_stage: int | None,
    pp_rank: int | None,
    record_max_logits: bool,
    attention_backend: str = "eager",
    grouped_experts: bool = False,
    max_logit_kernel: str = "torch",
    linears: dict | None = None,
):
    """megatron ``TransformerBlockSubmodules`` for the layers of one virtual stage, K2 modules in
    (``attention_backend``, ``grouped_experts``, ``max_logit_kernel``: see :func:`_swap_submodules`), the
    linear classes replaced by ``linears`` where given (:func:`swap_linears`; ``train.fp8_recipe``:
    :func:`te_linear_classes`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        tcfg,
        use_transformer_engine=False,
        normalization=tcfg.normalization,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    swapped = {}
    layers = []
    for s in block.layer_specs:
        if id(s) not in swapped:
            swapped[id(s)] = _swap_submodules(
                s, record_max_logits, attention_backend, grouped_experts, max_logit_kernel
            )
            if linears:
                swapped[id(s)] = swap_linears(swapped[id(s)], linears)
        layers.append(swapped[id(s)])
    block.layer_specs = layers
    return block


def reset_moe_process_state() -> None:
    """Forget megatron-core's process-wide MoE state left by an earlier model in this process.

    megatron keeps the router metrics in one global tracker whose per-layer tensors are sized by the
    first model that logs to it (``moe_logging.get_moe_metrics_tracker``), and the aux-loss gradient scale
    in a class attribute (``MoEAuxLossAutoScaler.main_loss_backward_scale``) whose shape the schedule then
    assumes. A second model in the same process (benchmarks, tests) with more layers indexed past the
    tracker's tensors ("index 3 is out of bounds for dimension 0 with size 3"), and a scalar left by a
    plain backward broke the schedule's ``[1]``-shaped copy. Every model we build starts from none of it.
    """
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    destroy_moe_metrics_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def build_model_chunks(
    cfg: K2Config, dims, tcfg, memory: MemoryOptions | None = None, memory_switches: Sequence[MemoryOptions] = ()
) -> list:
    """One megatron ``GPTModel`` per virtual pipeline stage held by this rank.

    Requires megatron ``parallel_state`` to be initialised for ``dims``. Core attention and routed
    experts follow ``k2.model.attention_backend`` and ``k2.model.moe_grouped_gemm`` (``auto`` / null: resolved
    for this process's device, :func:`k2.model.backends.resolve_attention_backend`,
    :func:`k2.model.backends.resolve_grouped_experts`); with ``train.fp8_recipe`` the linears are Transformer
    Engine's (:func:`te_linear_classes`, :func:`fp8_fields`). The activation memory switches
    (``memory``; default: from ``cfg.memory``) are installed on the chunks (``model/activation_memory.py``,
    megatron's selective recompute included: its per-module attributes are set whatever ``tcfg`` says);
    ``memory_switches`` are the other options the run will switch to between steps
    (:func:`k2.model.activation_memory.set_memory_options`; ``k2-train``: the schedule phases'), for which
    the layers get their saved-tensor scopes too.

    Returns:
        ``list[GPTModel]`` of length ``dims.vpp``; chunk ``v`` holds virtual stage ``v * pp + pp_rank``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    reset_moe_process_state()
    backend = resolve_attention_backend(cfg.model.attention_backend)
    grouped = resolve_grouped_experts(cfg.model.moe_grouped_gemm, cfg.train.precision)
    linears = te_linear_classes() if cfg.train.fp8_recipe is not None else None  # (model/backends.py checked)
    chunks = []
    for v in range(dims.vpp):
        vp_stage = v if dims.vpp > 1 else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        spec = decoder_block_spec(
            tcfg,
            vp_stage,
            ps.get_pipeline_model_parallel_rank(),
            bool(cfg.model.record_max_logits),
            backend,
            grouped,
            cfg.model.max_logit_kernel,
            linears,
        )
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=spec,
            vocab_size=cfg.model.vocab_size,
            max_sequence_length=cfg.model.max_position_embeddings,  # unused: no learned positions
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=cfg.model.share_embeddings_and_output_weights,
            position_embedding_type="none",  # MLA applies its own RoPE/YaRN on the rope head dims
            vp_stage=vp_stage,
        )
        if torch.cuda.is_available():
            # megatron creates its layers on the current device, but torch's RMSNorm modules (megatron's
            # WrappedTorchNorm: input/pre-MLP/q/kv/final norms) and the router weight on the host; only the
            # distributed optimizer's parameter buffer would move them (megatron-LM's get_model moves each
            # chunk the same way)
            model.to(torch.cuda.current_device())
        chunks.append(model)
    install_memory(chunks, memory if memory is not None else MemoryOptions.from_config(cfg), memory_switches)
    return chunks


def global_param_name(local_name: str, layer_numbers: dict[int, int], expert_offset: int) -> str:
    """Layout-independent name of a parameter.

    ``decoder.layers.<local i>.`` becomes ``decoder.layers.<global 0-based layer>.`` and
    ``experts.local_experts.<j>.`` becomes ``experts.<global expert>.``, so the same weight has the same
    name under any PP/VPP/EP layout.

    Args:
        local_name: name in this rank's model chunk.
        layer_numbers: local layer index -> global 0-based layer index.
        expert_offset: global index of this rank's first local expert (``ep_rank * experts_per_rank``).
    """
    parts = local_name.split(".")
    out = []
    i = 0
    while i < len(parts):
        p = parts[i]
        if p == "layers" and i + 1 < len(parts) and parts[i - 1 : i] == ["decoder"]:
            out += ["layers", str(layer_numbers[int(parts[i + 1])])]
            i += 2
            continue
        if p == "local_experts" and i + 1 < len(parts):
            out += ["global_experts", str(expert_offset + int(parts[i + 1]))]
            i += 2
            continue
        out.append(p)
        i += 1
    return ".".join(out)


@torch.no_grad()
def layout_independent_init(chunks: list, tcfg, seed: int) -> int:
    """Re-initialise every weight matrix from a generator seeded by its *global* name.

    megatron's own init draws from per-PP-rank / per-EP-rank RNG streams, so the same seed gives
    different weights under different layouts. Training sweeps and the parallel-equivalence tests need
    the same model for any PP/VPP/EP layout: here each matrix ``W`` of global name ``n`` is drawn as
    ``N(0, sigma^2)`` from ``torch.Generator().manual_seed(seed ^ crc32(n))`` with megatron's sigma
    (``init_method_std``; ``/ sqrt(2 * num_layers)`` for the output projections ``linear_proj`` and
    ``linear_fc2``, megatron's ``scaled_init_method_normal``). Norm weights stay 1, biases 0.

    Returns:
        number of parameters (elements) re-initialised on this rank.
    """
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank() if tcfg.num_moe_experts else 0
    per_rank = (tcfg.num_moe_experts or 0) // max(1, tcfg.expert_model_parallel_size)
    sigma = tcfg.init_method_std
    sigma_out = sigma / (2.0 * tcfg.num_layers) ** 0.5
    count = 0
    for chunk in chunks:
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
        for name, p in chunk.named_parameters():
            if p.dim() < 2:
                continue
            gname = global_param_name(name, layer_numbers, ep_rank * per_rank)
            std = sigma_out if (".linear_proj." in gname or ".linear_fc2." in gname) else sigma
            gen = torch.Generator(device="cpu").manual_seed((seed ^ zlib.crc32(gname.encode())) & (2**63 - 1))
            w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            p.copy_(w.to(device=p.device, dtype=p.dtype))
            count += p.numel()
    return count
