"""``config.json`` of a Hugging Face DeepSeek-V3 / Kimi K2 checkpoint from our model config, and the check
of a ``config.json`` against our model config (the field names are transformers' ``DeepseekV3Config``).

``model_type``: Kimi-K2-Base's ``config.json`` says ``kimi_k2`` and loads its configuration class from
the checkpoint's own code (``trust_remote_code``); the pinned transformers (5.23) registers
``deepseek_v3`` but not ``kimi_k2``, so an export says ``deepseek_v3`` by default (the same architecture
and fields, loadable by ``AutoModelForCausalLM.from_pretrained`` without custom code) and
``convert.model_type=kimi_k2`` writes K2's label instead. Import accepts either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k2.config.errors import ConfigError
from k2.launcher.hf.mapping import ARCHITECTURE, MODEL_TYPES

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig

#: our ``model.*`` key -> ``config.json`` field, for the fields both sides have one to one
FIELDS: tuple[tuple[str, str], ...] = (
    ("num_layers", "num_hidden_layers"),
    ("hidden_size", "hidden_size"),
    ("ffn_hidden_size", "intermediate_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"),
    ("qk_head_dim", "qk_nope_head_dim"),
    ("qk_pos_emb_head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "v_head_dim"),
    ("num_moe_experts", "n_routed_experts"),
    ("moe_router_topk", "num_experts_per_tok"),
    ("moe_ffn_hidden_size", "moe_intermediate_size"),
    ("moe_router_topk_scaling_factor", "routed_scaling_factor"),
    ("first_k_dense_replace", "first_k_dense_replace"),
    ("vocab_size", "vocab_size"),
    ("max_position_embeddings", "max_position_embeddings"),
    ("rotary_base", "rope_theta"),
    ("layernorm_epsilon", "rms_norm_eps"),
    ("share_embeddings_and_output_weights", "tie_word_embeddings"),
)
#: our YaRN keys -> ``rope_scaling`` fields
YARN_FIELDS: tuple[tuple[str, str], ...] = (
    ("rotary_scaling_factor", "factor"),
    ("original_max_position_embeddings", "original_max_position_embeddings"),
    ("beta_fast", "beta_fast"),
    ("beta_slow", "beta_slow"),
    ("mscale", "mscale"),
    ("mscale_all_dim", "mscale_all_dim"),
)
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def n_shared_experts(m: ModelConfig) -> int:
    """Shared experts of ``moe_ffn_hidden_size`` each (``n_shared_experts``).

    Raises:
        ConfigError: ``model.moe_shared_expert_intermediate_size`` is not a multiple of
            ``model.moe_ffn_hidden_size`` (HF has no other way to say it).
    """
    shared, f = int(m.moe_shared_expert_intermediate_size or 0), int(m.moe_ffn_hidden_size or 1)
    if shared % f:
        raise ConfigError(
            f"model.moe_shared_expert_intermediate_size={shared} is not a multiple of "
            f"model.moe_ffn_hidden_size={f}: not expressible as HF's n_shared_experts"
        )
    return shared // f


def hf_config(
    m: ModelConfig, rope_type: str, precision: str, model_type: str = "deepseek_v3", token_ids: dict | None = None
) -> dict:
    """``config.json`` for the model config ``m`` (``cfg.model``).

    Args:
        rope_type: ``rope`` | ``yarn``: what the checkpoint was trained with at its step;
            ``rope_scaling`` is written only for ``yarn``.
        precision: ``fp32`` | ``bf16`` (``torch_dtype``).
        model_type: ``deepseek_v3`` | ``kimi_k2`` (module docstring).
        token_ids: optional ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``.

    Raises:
        ConfigError: a model this format cannot express (not MLA, not a sigmoid router, ...).
    """
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"convert.model_type={model_type!r}; allowed: {', '.join(MODEL_TYPES)}")
    if not m.multi_latent_attention or m.normalization != "RMSNorm":
        raise ConfigError(
            "HF DeepSeek-V3 / K2 checkpoints need model.multi_latent_attention=true and "
            f"model.normalization=RMSNorm (got {m.multi_latent_attention}, {m.normalization})"
        )
    if m.num_moe_experts and m.moe_router_score_function != "sigmoid":
        raise ConfigError(
            f"model.moe_router_score_function={m.moe_router_score_function!r}: DeepSeek-V3 / "
            "K2 route with sigmoid scores"
        )
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": model_type,
        **{hf: _plain(m[ours]) for ours, hf in FIELDS},
        "num_key_value_heads": int(m.num_attention_heads),
        "n_shared_experts": n_shared_experts(m) if m.num_moe_experts else 0,
        "n_group": int(m.moe_router_num_groups or 1),
        "topk_group": int(m.moe_router_group_topk or 1),
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_interleave": True,
        # no multi-token-prediction layers (K2 has none; transformers reads a missing field as 1)
        "num_nextn_predict_layers": 0,
        # the training settings of this checkpoint, not architecture: init std and sequence-level aux-loss
        # coefficient (K2's recipe takes 0.006 and 1e-4 from the DeepSeek-V3 report, section 4.2; the K2
        # report gives neither). Kimi-K2's published config.json carries 0.02 and 1e-3, transformers'
        # DeepseekV3Config defaults, which inference does not read
        "initializer_range": float(m.init_method_std),
        "aux_loss_alpha": float(m.moe_aux_loss_coeff or 0.0),
        "seq_aux": m.moe_router_load_balancing_type == "seq_aux_loss",
        "use_cache": True,
        "torch_dtype": _DTYPE_NAMES[precision],
        "rope_scaling": None,
    }
    if rope_type == "yarn":
        cfg["rope_scaling"] = {"type": "yarn", **{hf: _plain(m[ours]) for ours, hf in YARN_FIELDS}}
    cfg.update(token_ids or {})
    return cfg


def _plain(v):
    return float(v) if isinstance(v, float) else v


def check_hf_config(hf: dict, m: ModelConfig, source: str) -> None:
    """Refuse a ``config.json`` that does not describe the model config ``m`` (``cfg.model``).

    Raises:
        ConfigError: not a DeepSeek-V3 / K2 checkpoint (architecture, model type, routing), or one line
            naming every field that differs with both values and the ``model.*`` override that matches.
    """
    arch = hf.get("architectures") or []
    if ARCHITECTURE not in arch or hf.get("model_type") not in MODEL_TYPES:
        raise ConfigError(
            f"{source}: architectures={arch} model_type={hf.get('model_type')!r} is not a "
            f"K2-family checkpoint; allowed: architectures [{ARCHITECTURE}] with model_type "
            f"{' or '.join(MODEL_TYPES)}"
        )
    for field, want in (
        ("scoring_func", "sigmoid"),
        ("hidden_act", "silu"),
        ("moe_layer_freq", 1),
        ("attention_bias", False),
        ("rope_interleave", True),
    ):
        if field in hf and hf[field] != want:
            raise ConfigError(
                f"{source}: {field}={hf[field]!r}; this converter supports {field}={want!r} (K2 / DeepSeek-V3)"
            )
    if hf.get("norm_topk_prob") is False and hf.get("num_experts_per_tok", 1) > 1:
        raise ConfigError(f"{source}: norm_topk_prob=false; K2's router normalises the top-k gates")
    diffs = []
    for ours, field in FIELDS:
        if field in ("max_position_embeddings", "tie_word_embeddings") and field not in hf:
            continue
        got = hf.get(field)
        want = m[ours]
        if not _same(got, want):
            diffs.append(f"{field}={got!r} vs model.{ours}={want!r}")
    if m.num_moe_experts:
        for field, want in (
            ("n_shared_experts", n_shared_experts(m)),
            ("n_group", int(m.moe_router_num_groups or 1)),
            ("topk_group", int(m.moe_router_group_topk or 1)),
        ):
            got = hf[field] if field in hf else transformers_default(field)
            if not _same(got, want):
                shown = repr(got) if field in hf else f"{got!r} (transformers' default: config.json omits it)"
                diffs.append(f"{field}={shown} vs {want!r} from model.*")
    rs = hf.get("rope_scaling")
    if rs:
        kind = rs.get("type", rs.get("rope_type"))
        if kind != "yarn":
            raise ConfigError(f"{source}: rope_scaling type {kind!r}; allowed: yarn (or none)")
        for ours, field in YARN_FIELDS:
            if field in rs and not _same(rs[field], m[ours]):
                diffs.append(f"rope_scaling.{field}={rs[field]!r} vs model.{ours}={m[ours]!r}")
    if diffs:
        raise ConfigError(
            f"{source} does not match the model config (model={m.name}): "
            + "; ".join(diffs)
            + "; pick the matching model recipe or set those model.* keys"
        )


def transformers_default(field: str):
    """The value transformers' ``DeepseekV3Config`` reads for ``field`` when ``config.json`` omits it
    (e.g. ``n_group`` 8, ``topk_group`` 4, ``num_nextn_predict_layers`` 1 in transformers 5)."""
    from transformers import DeepseekV3Config

    return getattr(DeepseekV3Config(), field)


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b)) <= 1e-9 * max(1.0, abs(float(b)))
    return a == b
