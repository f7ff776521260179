"""Activation bytes one microbatch's forward keeps for its backward, per layer, with the ``memory.*`` switches.

Why our own code: megatron-core has no activation-memory model for MLA + MoE layers (Megatron-LM's
``theoretical_memory_usage`` covers dense GPT layers only and none of K2's switches).

The inventory below lists what autograd saves in ``k2-train``'s layers: megatron-core 0.19.2's MLA
(``MLASelfAttention``), SwiGLU ``MLP``, ``MoELayer`` with ``TopKRouter`` (FP32), the alltoall token dispatcher
and ``SequentialMLP`` experts (the router probabilities multiply the SwiGLU output inside each expert), our
:class:`k2.model.attention.K2CoreAttention` and torch's RMSNorm. It was read off saved-tensor hooks on the CPU
proxy; ``tests/unit/launcher/planning/test_memory_plan.py`` checks the total against the bytes measured the same
way. Notation: ``T = micro_batch_size x seq_length`` tokens, ``Tk = T x top-k`` routed token copies (the
expected count on every EP rank: the all-to-all exchanges as many tokens as it receives on average), ``B`` = 2
bytes (BF16) or 4 (FP32) per element, widths as in :mod:`k2.model.flops`.

Per layer (``site`` = the ``memory.*`` site names of ``config/schema.py`` that act on the tensor: ``O``
offload, ``F`` FP8 storage, ``R`` recompute drops it):

* attention RMSNorm (``input_layernorm``): the layer input and the normalised ``x * rstd`` (composite
  norm: both FP32, ``2 x 4 T h``; fused CUDA norm: the input, ``B T h``) + ``rstd`` (FP32, ``4 T``)
  [O attn_input: the layer input (a BF16 input's FP32 copy is a storage of its own, not moved); R layernorm
  drops ``x * rstd``, ``rstd`` and the FP32 copy: the recompute saves the input itself];
* its output, the input of the q/kv down-projections, ``B T h`` [O mla_up_proj; R layernorm, which wins:
  a recomputed tensor is never offloaded];
* q latent (``B T r_q``), kv latent with the rope key (``B T (r_kv + d_r)``), their RMSNorms (as above,
  on ``r_q`` / ``r_kv``; the composite norm's FP32 input copy of a BF16 kv latent leaves out the rope key)
  and the normalised latents fed to the up-projections (``B T (r_q + r_kv)``) [O mla_up_proj];
* q, k, v after the up-projections and RoPE, ``B T H (2 (d_qk + d_r) + d_v)`` [O core_attn; R mla_up_proj
  drops them: core attention saves these tensors (SDPA) or views of them (CPU), and the recompute
  (model/recompute.py) rebuilds every output of the up-projections from the normalised latents];
* core attention: fused (SDPA/cuDNN on GPU) the output ``B T H d_v`` + log-sum-exp ``4 T H``; unfused
  (CPU) the FP32 softmax probabilities ``4 b H s^2`` (and their copy in the compute dtype for ``p v``
  when that is BF16, ``2 b H s^2``) + a causal mask ``s^2`` (1 byte) [O core_attn];
* RoPE tables: cos and sin for q and for k in the compute dtype, ``4 x B s d_r`` (independent of the batch;
  megatron's ``_apply_rotary_pos_emb_bshd`` casts them to the input's dtype and the products save them)
  [R mla_up_proj: made inside the recomputed up-projections. The checkpoint saves its inputs instead: the
  FP32 frequencies ``[s, 1, 1, d_r]``, megatron's ``RotaryEmbedding`` lru_cache entry held for the whole
  run whatever is saved (no bytes per microbatch), and the rope key, a view of the kv latent's storage
  ``B T (r_kv + d_r)``: the kv RMSNorm's saved input where that is the latent itself (FP32, fused norm),
  a storage of its own with the composite norm in BF16 (which keeps an FP32 copy) [O mla_up_proj]];
* ``linear_proj`` input, ``B T H d_v`` [O attn_proj];
* MLP RMSNorm (``pre_mlp_layernorm``) as the attention one [O mlp_input; R layernorm], and its output
  (input of the router, the shared expert and the dense FFN) ``B T h`` [R layernorm];
* dense / shared-expert SwiGLU of width ``f`` on ``T`` tokens and each routed expert's on its tokens
  (``Tk`` in all): ``linear_fc1`` output ``2 f`` [F swiglu_input; O swiglu_input]; SwiGLU internals
  ``silu(gate)`` (``f``: the product's other factor ``up`` is a view of the ``linear_fc1`` output, the same
  storage; routed experts also the output before the probability scaling, ``f``, not saved with
  moe_down_proj) [R swiglu]; ``linear_fc2`` input ``f`` [O fc2_input; R swiglu];
* routed experts' permuted input ``B Tk h`` [F moe_fc1_input; O moe_fc1_input]; router (FP32 scores
  and INT64 routing map ``16 T E``, top-k values and indices ``12 Tk``, ``8 T``, ``16 E + 4``);
  permutation indices ``32 Tk``; expert probabilities ``4 Tk``;
* megatron's module recompute sites (``k2-plan`` only; ``k2-train`` refuses them): ``core_attn`` drops core
  attention's saved tensors (its inputs q, k, v stay), ``mlp`` a dense layer's SwiGLU MLP, ``moe`` a MoE
  layer's router, permutation, routed and shared experts (the MLP norm's output, their input, stays);
* ``moe_down_proj``: megatron-core 0.19.2's ``SequentialMLP`` scales by the router probabilities *before*
  ``linear_fc2`` (saving the SwiGLU output before the scaling); with the switch on, the routed experts
  scale ``linear_fc2``'s output instead (K2's placement, ``model/mlp.py``), and that output ``[Tk, h]``,
  saved for the probabilities' gradient, is recomputed: neither is kept.

Embedding stage: the token ids (INT64, ``8 T``). Loss stage: the final RMSNorm (as above), the output
head's input ``B T h``, the cross-entropy's FP32 softmax ``4 T V`` and labels/mask ``9 T``.

Whole-layer recompute (``memory.recompute`` site ``layer``): a layer keeps only its input ``B T h`` [O
attn_input] (:func:`layer_recompute_saved`); its backward re-runs it and holds, for that one layer, what
:func:`layer_saved` lists under the FP8 and selective recompute switches (no offload).

Switches: FP8 storage keeps 1 byte per element + one FP32 scale per 128 elements (``1 x 128`` tiles);
recompute drops the tensor; offload moves it to host memory (counted in ``offloaded``, not on the GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k2.config.schema import MEMORY_FP8_SITES, MEMORY_OFFLOAD_SITES, MEMORY_RECOMPUTE_SITES

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig

__all__ = ["Saved", "SITES", "apply_switches", "layer_recompute_saved", "layer_saved", "stage_saved"]

#: memory.* site names (config/schema.py, the one list of them).
SITES = {
    "fp8_store": tuple(MEMORY_FP8_SITES),
    "recompute": tuple(MEMORY_RECOMPUTE_SITES),
    "offload": tuple(MEMORY_OFFLOAD_SITES),
}
FP8_TILE = 128  # elements per FP32 scale


@dataclass(frozen=True)
class Saved:
    """One tensor (or group of same-kind tensors) kept for backward.

    Attributes:
        name: what it is.
        elements: number of elements per microbatch (a routed count may be fractional: expected value).
        bytes_per_element: storage size of one element.
        offload: the ``memory.offload`` site that moves it to host, or None.
        fp8: the ``memory.fp8_store`` site that stores it as FP8, or None.
        recompute: the ``memory.recompute`` site whose recomputation drops it (or a tuple of sites, any of
            which drops it), or None.
        only_with: the ``memory.recompute`` site without which the tensor is not saved at all (the
            recompute checkpoint's own saved input), or None.
    """

    name: str
    elements: float
    bytes_per_element: float
    offload: str | None = None
    fp8: str | None = None
    recompute: str | tuple | None = None
    only_with: str | None = None

    @property
    def nbytes(self) -> float:
        return self.elements * self.bytes_per_element


def _norm(
    prefix: str,
    tokens: float,
    width: int,
    B: int,
    fused: bool,
    offload: str | None,
    recompute: str | None,
    input_extra: int = 0,
) -> list[Saved]:
    """What an RMSNorm over ``width`` saves: fused CUDA kernel = its input + FP32 rstd; torch's composite
    (CPU) = FP32 copies of the input and of ``x * rstd`` + rstd. ``recompute`` drops everything but the
    input; ``offload`` moves the input (the residual-stream sites ``attn_input`` / ``mlp_input`` name
    the layer input only); ``input_extra`` more columns share the input's storage (the kv latent's rope
    key)."""
    if fused:
        width_in = width + input_extra
        return [
            Saved(f"{prefix}.input", tokens * width_in, B, offload),
            Saved(f"{prefix}.rstd", tokens, 4, recompute=recompute),
        ]
    # composite: an FP32 input is saved as is (a view keeps its whole storage); a BF16 one as an FP32 copy,
    # a new storage that the offload sites (which match the input's storage) do not move. Recomputed, the
    # norm's internals are not saved; its checkpoint saves the BF16 input itself.
    width_in = width + input_extra if B == 4 else width
    if B == 4:
        saved_input = [Saved(f"{prefix}.input", tokens * width_in, 4, offload)]
    else:
        saved_input = [Saved(f"{prefix}.input_fp32_copy", tokens * width_in, 4, recompute=recompute)]
        if recompute is not None:
            saved_input.append(Saved(f"{prefix}.input", tokens * width_in, B, offload, only_with=recompute))
    return saved_input + [
        Saved(f"{prefix}.x_rstd", tokens * width, 4, recompute=recompute),
        Saved(f"{prefix}.rstd", tokens, 4, recompute=recompute),
    ]


def _swiglu(prefix: str, tokens: float, width: int, B: int, routed: bool, module: str) -> list[Saved]:
    """A SwiGLU MLP's saved tensors; ``module``: the recompute site that re-runs the whole MLP (megatron's
    ``mlp`` for a dense layer's, ``moe`` for a MoE layer's experts), which drops all of them."""
    out = [
        Saved(f"{prefix}.fc1_output", tokens * 2 * width, B, "swiglu_input", "swiglu_input", recompute=module),
        Saved(f"{prefix}.silu_output", tokens * width, B, recompute=("swiglu", module)),
    ]
    if routed:
        # with moe_down_proj the probabilities multiply fc2's output instead (model/mlp.py): not saved
        out.append(
            Saved(f"{prefix}.act_before_probs", tokens * width, B, recompute=("swiglu", "moe_down_proj", module))
        )
    out.append(Saved(f"{prefix}.fc2_input", tokens * width, B, "fc2_input", recompute=("swiglu", module)))
    return out


def layer_saved(
    model_cfg: ModelConfig, moe: bool, seq_length: int, micro_batch_size: int, precision: str, fused_kernels: bool
) -> list[Saved]:
    """The tensors one transformer layer keeps for backward for one microbatch (module docstring).

    Args:
        model_cfg: ``cfg.model``.
        moe: an MoE layer (else dense).
        seq_length, micro_batch_size: the microbatch shape (tokens per sequence, sequences).
        precision: ``bf16`` | ``fp32`` (``train.precision``).
        fused_kernels: GPU kernels (fused RMSNorm, SDPA attention) instead of the CPU's composite ones.
    """
    m = model_cfg
    B = 2 if precision == "bf16" else 4
    s, b = int(seq_length), int(micro_batch_size)
    T = s * b
    h, H = int(m.hidden_size), int(m.num_attention_heads)
    d_qk, d_r, d_v = int(m.qk_head_dim), int(m.qk_pos_emb_head_dim), int(m.v_head_dim)
    r_q, r_kv = m.q_lora_rank, int(m.kv_lora_rank)
    out = _norm("attn_norm", T, h, B, fused_kernels, "attn_input", "layernorm")
    out.append(Saved("attn_norm.output", T * h, B, "mla_up_proj", recompute="layernorm"))
    # the latents are their RMSNorms' inputs (the kv latent includes the shared rope key)
    for name, width, extra in (("q_latent", r_q, 0), ("kv_latent", r_kv, d_r)):
        if not width:
            continue
        out += _norm(name, T, width, B, fused_kernels, "mla_up_proj", None, input_extra=extra)
        out.append(Saved(f"{name}.norm_output", T * width, B, "mla_up_proj"))
    if B != 4 and not fused_kernels:
        # the mla_up_proj checkpoint saves its inputs, among them the rope key, a view of the kv latent's
        # storage [T, r_kv + d_r]: a storage of its own here (the composite norm kept an FP32 copy of the
        # latent, not the latent); the norm's saved input otherwise (FP32, fused norm), counted there
        out.append(Saved("kv_latent.rope_key_view", T * (r_kv + d_r), B, "mla_up_proj", only_with="mla_up_proj"))
    # core attention saves the up-projections' outputs (SDPA) or views of them (the CPU path), which the
    # mla_up_proj recompute drops (model/recompute.py marks every output of the recomputed function)
    out.append(Saved("q_k_v", T * H * (2 * (d_qk + d_r) + d_v), B, "core_attn", recompute="mla_up_proj"))
    # (megatron's core_attn recompute checkpoints core attention: its inputs q, k, v stay, these go)
    if fused_kernels:
        out += [
            Saved("core_attn.output", T * H * d_v, B, "core_attn", recompute="core_attn"),
            Saved("core_attn.logsumexp", T * H, 4, "core_attn", recompute="core_attn"),
        ]
    else:
        out += [
            Saved("core_attn.probs", b * H * s * s, 4 if B == 4 else 4 + B, "core_attn", recompute="core_attn"),
            Saved("core_attn.causal_mask", s * s, 1, "core_attn", recompute="core_attn"),
        ]
    # cos and sin in the compute dtype, for q and for k: made inside the up-projections' function, which
    # the mla_up_proj checkpoint runs without autograd (the frequencies it saves instead are megatron's
    # RotaryEmbedding lru_cache entry, held for the whole run: no bytes per microbatch)
    out.append(Saved("rope_tables", 4 * s * d_r, B, recompute="mla_up_proj"))
    out.append(Saved("attn_proj.input", T * H * d_v, B, "attn_proj"))
    out += _norm("mlp_norm", T, h, B, fused_kernels, "mlp_input", "layernorm")
    out.append(Saved("mlp_norm.output", T * h, B, recompute="layernorm"))
    if not moe:
        return out + _swiglu("dense_mlp", T, int(m.ffn_hidden_size), B, routed=False, module="mlp")
    E, k = int(m.num_moe_experts), int(m.moe_router_topk)
    Tk = T * k
    # (megatron's moe recompute checkpoints the MoE layer: its input, the MLP norm's output, stays)
    out += [
        Saved("router", 16 * T * E + 12 * Tk + 8 * T + 16 * E + 4, 1, recompute="moe"),
        Saved("permutation_indices", Tk, 32, recompute="moe"),
        Saved("routed.fc1_input", Tk * h, B, "moe_fc1_input", "moe_fc1_input", recompute="moe"),
        Saved("routed.probs", Tk, 4, recompute="moe"),
    ]
    out += _swiglu("routed", Tk, int(m.moe_ffn_hidden_size), B, routed=True, module="moe")
    f_s = m.moe_shared_expert_intermediate_size
    if f_s:
        out += _swiglu("shared", T, int(f_s), B, routed=False, module="moe")
    return out


def layer_recompute_saved(
    model_cfg: ModelConfig, seq_length: int, micro_batch_size: int, precision: str
) -> list[Saved]:
    """What one transformer layer keeps for backward with ``memory.recompute`` site ``layer`` (whole-layer
    recompute, ``model/recompute.py``): its input ``[s, b, h]`` alone (offload site ``attn_input``). The
    layer's other tensors exist only while its backward re-runs it: :func:`layer_saved` with FP8 storage and
    the selective recompute sites but no offload (``model/recompute.py``), one layer at a time."""
    B = 2 if precision == "bf16" else 4
    T = int(seq_length) * int(micro_batch_size)
    return [Saved("layer.input", T * int(model_cfg.hidden_size), B, "attn_input")]


def stage_saved(
    model_cfg: ModelConfig,
    seq_length: int,
    micro_batch_size: int,
    precision: str,
    fused_kernels: bool,
    embedding: bool,
    loss: bool,
) -> list[Saved]:
    """The extra tensors of the embedding stage (token ids) and of the loss stage (final norm, output head
    input, cross-entropy softmax and labels) for one microbatch."""
    B = 2 if precision == "bf16" else 4
    T = int(seq_length) * int(micro_batch_size)
    h, V = int(model_cfg.hidden_size), int(model_cfg.vocab_size)
    out: list[Saved] = []
    if embedding:
        out.append(Saved("token_ids", T, 8))
    if loss:
        out += _norm("final_norm", T, h, B, fused_kernels, None, None)
        out += [
            Saved("output_head.input", T * h, B),
            Saved("cross_entropy.softmax", T * V, 4),
            Saved("cross_entropy.labels_mask", T, 9),
        ]
    return out


def apply_switches(
    saved: Iterable[Saved],
    fp8_store: Iterable[str] = (),
    recompute: Iterable[str] = (),
    offload: Iterable[str] = (),
    host_block: Callable[[float], float] | None = None,
) -> tuple[float, float]:
    """GPU bytes and host (offloaded) bytes of ``saved`` under the ``memory.*`` switches; ``host_block``:
    the host bytes one offloaded entry of ``n`` bytes holds (e.g. a pinned allocator's block), None = ``n``.

    Returns:
        ``(gpu_bytes, offloaded_bytes)``.

    Raises:
        ValueError: a site name this model does not know (``SITES``).
    """
    fp8_store, recompute, offload = set(fp8_store), set(recompute), set(offload)
    for key, names in (("fp8_store", fp8_store), ("recompute", recompute), ("offload", offload)):
        unknown = names - set(SITES[key])
        if unknown:
            raise ValueError(f"memory.{key} has {sorted(unknown)}; allowed: {', '.join(SITES[key])}")
    gpu = host = 0.0
    for x in saved:
        sites = (x.recompute,) if isinstance(x.recompute, str) else (x.recompute or ())
        if any(site in recompute for site in sites):
            continue
        if x.only_with is not None and x.only_with not in recompute:
            continue
        nbytes = x.nbytes
        if x.fp8 is not None and x.fp8 in fp8_store:
            nbytes = x.elements * (1 + 4 / FP8_TILE)
        if x.offload is not None and x.offload in offload:
            host += nbytes if host_block is None else host_block(nbytes)
        else:
            gpu += nbytes
    return gpu, host
