"""The one table between our checkpoints and Hugging Face's DeepSeek-V3 / Kimi K2 checkpoints.

Our side: the keys of megatron-core's sharded state dict as a k2-launcher checkpoint stores them
(``torch_dist``; layout-independent: global layer numbers, experts by global index, so a checkpoint
written at any PP / VPP / EP / DP has the same keys and global shapes). Their side: the tensor names of
``transformers``' ``DeepseekV3ForCausalLM`` checkpoint format, which Kimi-K2-Base and DeepSeek-V3 are
published in (one tensor per expert and projection).

:data:`LAYER_TABLE` is that table, row by row (``{i}`` = 0-based layer, ``{e}`` = global expert); the
conventions it relies on, stated once:

* **SwiGLU ``[gate; up]``**: megatron keeps a gated MLP's two input projections as one ``linear_fc1``
  weight ``[2F, H]``: rows ``[0, F)`` are the gate (``gate_proj``, through SiLU), rows ``[F, 2F)`` the
  up projection (``up_proj``) -- megatron's ``glu`` splits the output with ``torch.chunk(x, 2, -1)``.
  A row with ``part`` ``gate`` / ``up`` is that half; export splits, import concatenates.
* **Experts**: megatron's ``SequentialMLP`` stores the routed experts of a layer as one
  ``[E, 2F, H]`` / ``[E, H, F]`` tensor per projection (chunks by expert); HF has one tensor per expert
  (``mlp.experts.{e}.gate_proj.weight``, ...). A row with ``expert=True`` is expert ``e``'s slice.
* **Expert bias**: megatron's ``router.expert_bias`` (aux-loss-free balancing, kept in FP32) is HF's
  ``mlp.gate.e_score_correction_bias``; the router weight ``router.weight`` is ``mlp.gate.weight``.
* **Interleaved RoPE**: both sides store the rotary rows of ``linear_q_up_proj`` / ``q_b_proj`` and the
  last ``qk_rope_head_dim`` rows of ``linear_kv_down_proj`` / ``kv_a_proj_with_mqa`` in DeepSeek's
  interleaved pair order; megatron's MLA de-interleaves at run time (``apply_rotary_pos_emb(...,
  mla_rotary_interleaved=True)``) exactly as transformers does with ``rope_interleave: true``, so the
  rows map one to one (no permutation) and ``config.json`` says ``rope_interleave: true``.
* **Latent norms**: MLA's RMSNorms on the compressed latents, ``q_layernorm`` / ``kv_layernorm``
  (megatron, ``qk_layernorm=True``), are HF's ``q_a_layernorm`` / ``kv_a_layernorm``.
* **Per-head layouts**: ``linear_kv_up_proj`` and ``kv_b_proj`` both hold per head ``[k_nope; v]`` rows,
  ``linear_q_up_proj`` and ``q_b_proj`` per head ``[q_nope; q_rope]``: identical, no reshuffle.
* **Norm names**: megatron's ``pre_mlp_layernorm`` is HF's ``post_attention_layernorm`` (both the RMSNorm
  before the MLP); ``decoder.final_layernorm`` is ``model.norm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k2.config.choices import ConvertModelType, values

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig

#: HF checkpoints this converter reads and writes (``config.json``'s ``architectures`` / ``model_type``)
ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPES = values(ConvertModelType)  # deepseek_v3, kimi_k2 (convert.model_type)
#: a sharded HF checkpoint's index: ``{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}``
INDEX_FILE = "model.safetensors.index.json"
#: the dtype names of ``convert.dtype`` / ``train.precision`` -> torch dtype names
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Row:
    """One row of the table: an HF tensor and where it lives in our checkpoint.

    Attributes:
        hf: HF tensor name (``{i}`` layer, ``{e}`` expert).
        ours: megatron sharded-state-dict key (``{i}`` layer).
        where: ``all`` (every layer), ``dense`` (layers ``< first_k_dense_replace``), ``moe`` (the rest),
            ``q_lora`` / ``no_q_lora`` (with / without ``q_lora_rank``).
        part: ``gate`` / ``up``: that half of a ``[gate; up]`` ``linear_fc1`` (dim -2); None: whole.
        expert: the key is an ``[E, ...]`` stack; the row is expert ``{e}``'s slice (dim 0).
        linear: a megatron linear layer: its sharded state dict also holds an ``._extra_state`` object.
        fp32: always kept in FP32 by our model (the expert bias buffer), whatever the training dtype.
    """

    hf: str
    ours: str
    where: str = "all"
    part: str | None = None
    expert: bool = False
    linear: bool = False
    fp32: bool = False


_A = "decoder.layers.{i}.self_attention."
_M = "decoder.layers.{i}.mlp."
_HA = "model.layers.{i}.self_attn."
_HM = "model.layers.{i}.mlp."

#: Every tensor of a decoder layer (module docstring: the conventions).
LAYER_TABLE: tuple[Row, ...] = (
    Row("model.layers.{i}.input_layernorm.weight", "decoder.layers.{i}.input_layernorm.weight"),
    Row(_HA + "q_a_proj.weight", _A + "linear_q_down_proj.weight", "q_lora", linear=True),
    Row(_HA + "q_a_layernorm.weight", _A + "q_layernorm.weight", "q_lora"),
    Row(_HA + "q_b_proj.weight", _A + "linear_q_up_proj.weight", "q_lora", linear=True),
    Row(_HA + "q_proj.weight", _A + "linear_q_proj.weight", "no_q_lora", linear=True),
    Row(_HA + "kv_a_proj_with_mqa.weight", _A + "linear_kv_down_proj.weight", linear=True),
    Row(_HA + "kv_a_layernorm.weight", _A + "kv_layernorm.weight"),
    Row(_HA + "kv_b_proj.weight", _A + "linear_kv_up_proj.weight", linear=True),
    Row(_HA + "o_proj.weight", _A + "linear_proj.weight", linear=True),
    Row("model.layers.{i}.post_attention_layernorm.weight", "decoder.layers.{i}.pre_mlp_layernorm.weight"),
    # dense SwiGLU layers
    Row(_HM + "gate_proj.weight", _M + "linear_fc1.weight", "dense", part="gate", linear=True),
    Row(_HM + "up_proj.weight", _M + "linear_fc1.weight", "dense", part="up", linear=True),
    Row(_HM + "down_proj.weight", _M + "linear_fc2.weight", "dense", linear=True),
    # MoE layers: router, expert bias, routed experts, shared expert(s)
    Row(_HM + "gate.weight", _M + "router.weight", "moe"),
    Row(_HM + "gate.e_score_correction_bias", _M + "router.expert_bias", "moe", fp32=True),
    Row(
        _HM + "experts.{e}.gate_proj.weight",
        _M + "experts.experts.linear_fc1.weight",
        "moe",
        part="gate",
        expert=True,
        linear=True,
    ),
    Row(
        _HM + "experts.{e}.up_proj.weight",
        _M + "experts.experts.linear_fc1.weight",
        "moe",
        part="up",
        expert=True,
        linear=True,
    ),
    Row(
        _HM + "experts.{e}.down_proj.weight", _M + "experts.experts.linear_fc2.weight", "moe", expert=True, linear=True
    ),
    Row(
        _HM + "shared_experts.gate_proj.weight",
        _M + "shared_experts.linear_fc1.weight",
        "moe",
        part="gate",
        linear=True,
    ),
    Row(_HM + "shared_experts.up_proj.weight", _M + "shared_experts.linear_fc1.weight", "moe", part="up", linear=True),
    Row(_HM + "shared_experts.down_proj.weight", _M + "shared_experts.linear_fc2.weight", "moe", linear=True),
)

#: Tensors outside the decoder layers (untied embedding and output head).
EDGE_TABLE: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    ("model.norm.weight", "decoder.final_layernorm.weight"),
    ("lm_head.weight", "output_layer.weight"),
)


@dataclass(frozen=True)
class Tensor:
    """One HF tensor, resolved for a model: its name, our key and where in our key it sits.

    Attributes:
        hf: HF name. key: our sharded key. shape: the HF tensor's shape (elements).
        key_shape: the global shape of our key. expert: index into dim 0 of our key (None: whole).
        part: ``gate`` / ``up`` half of dim -2 of our key (None: whole). linear / fp32: see :class:`Row`.
    """

    hf: str
    key: str
    shape: tuple
    key_shape: tuple
    expert: int | None = None
    part: str | None = None
    linear: bool = False
    fp32: bool = False


def _row_applies(row: Row, m: ModelConfig, layer: int) -> bool:
    dense = not m.num_moe_experts or layer < int(m.first_k_dense_replace)
    return {
        "all": True,
        "dense": dense,
        "moe": not dense,
        "q_lora": m.q_lora_rank is not None,
        "no_q_lora": m.q_lora_rank is None,
    }[row.where]


def _key_shape(key: str, m: ModelConfig) -> tuple:
    """Global shape of our sharded key ``key`` (one layer's) for the model config ``m``."""
    h, heads = int(m.hidden_size), int(m.num_attention_heads)
    qk, rope, v = int(m.qk_head_dim), int(m.qk_pos_emb_head_dim), int(m.v_head_dim)
    name = key.split(".", 3)[-1] if key.startswith("decoder.layers.") else key
    shared = int(m.moe_shared_expert_intermediate_size or 0)
    e, f = int(m.num_moe_experts or 0), int(m.moe_ffn_hidden_size or 0)
    shapes = {
        "input_layernorm.weight": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_q_down_proj.weight": (m.q_lora_rank, h),
        "self_attention.q_layernorm.weight": (m.q_lora_rank,),
        "self_attention.linear_q_up_proj.weight": (heads * (qk + rope), m.q_lora_rank),
        "self_attention.linear_q_proj.weight": (heads * (qk + rope), h),
        "self_attention.linear_kv_down_proj.weight": (int(m.kv_lora_rank) + rope, h),
        "self_attention.kv_layernorm.weight": (int(m.kv_lora_rank),),
        "self_attention.linear_kv_up_proj.weight": (heads * (qk + v), int(m.kv_lora_rank)),
        "self_attention.linear_proj.weight": (h, heads * v),
        "mlp.linear_fc1.weight": (2 * int(m.ffn_hidden_size), h),
        "mlp.linear_fc2.weight": (h, int(m.ffn_hidden_size)),
        "mlp.router.weight": (e, h),
        "mlp.router.expert_bias": (e,),
        "mlp.experts.experts.linear_fc1.weight": (e, 2 * f, h),
        "mlp.experts.experts.linear_fc2.weight": (e, h, f),
        "mlp.shared_experts.linear_fc1.weight": (2 * shared, h),
        "mlp.shared_experts.linear_fc2.weight": (h, shared),
        "embedding.word_embeddings.weight": (int(m.vocab_size), h),
        "decoder.final_layernorm.weight": (h,),
        "output_layer.weight": (int(m.vocab_size), h),
    }
    return tuple(int(x) for x in shapes[name])


def _hf_shape(key_shape: tuple, expert: bool, part: str | None) -> tuple:
    shape = list(key_shape[1:] if expert else key_shape)
    if part is not None:
        shape[-2] //= 2
    return tuple(shape)


def layer_tensors(m: ModelConfig, layer: int) -> list[Tensor]:
    """The HF tensors of decoder layer ``layer`` (0-based) of the model config ``m`` (``cfg.model``), in
    table order, routed experts expanded (gate, up, down of expert 0, then expert 1, ...)."""
    plain, experts = [], []
    for row in LAYER_TABLE:
        if not _row_applies(row, m, layer):
            continue
        key = row.ours.format(i=layer)
        ks = _key_shape(key, m)
        t = Tensor(row.hf, key, _hf_shape(ks, row.expert, row.part), ks, None, row.part, row.linear, row.fp32)
        (experts if row.expert else plain).append(t)
    out = [Tensor(t.hf.format(i=layer), t.key, t.shape, t.key_shape, None, t.part, t.linear, t.fp32) for t in plain]
    for e in range(int(m.num_moe_experts or 0) if experts else 0):
        out += [
            Tensor(t.hf.format(i=layer, e=e), t.key, t.shape, t.key_shape, e, t.part, t.linear, t.fp32) for t in experts
        ]
    return out


def edge_tensors(m: ModelConfig) -> list[Tensor]:
    """Embedding, final norm and output head (the output head is absent with tied embeddings)."""
    out = []
    for hf, key in EDGE_TABLE:
        if key == "output_layer.weight" and m.share_embeddings_and_output_weights:
            continue
        ks = _key_shape(key, m)
        out.append(Tensor(hf, key, ks, ks, linear=False))
    return out


def tensor_groups(m: ModelConfig) -> list[tuple[str, list[Tensor]]]:
    """Every HF tensor of the model in groups that are converted together: ``("embedding", [...])``, one
    group per layer's attention + norms + router + shared expert, one per routed expert
    (``"layer 3 expert 17"``), then ``("head", [...])``. A group holds whole ``[gate; up]`` pairs, so a
    ``linear_fc1`` is never split across groups."""
    edges = {t.key: t for t in edge_tensors(m)}
    groups = [("embedding", [edges["embedding.word_embeddings.weight"]])]
    for i in range(int(m.num_layers)):
        ts = layer_tensors(m, i)
        groups.append((f"layer {i}", [t for t in ts if t.expert is None]))
        by_expert: dict[int, list[Tensor]] = {}
        for t in ts:
            if t.expert is not None:
                by_expert.setdefault(t.expert, []).append(t)
        groups += [(f"layer {i} expert {e}", g) for e, g in by_expert.items()]
    groups.append(("head", [t for k, t in edges.items() if k != "embedding.word_embeddings.weight"]))
    return groups


def numel(shape) -> int:
    return int(math.prod(shape))
