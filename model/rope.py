"""The RoPE / YaRN fields of megatron's ``MLATransformerConfig`` from ``model.*``, and the switch between them at
a schedule phase boundary (K2 pretrains at 4K with plain RoPE and extends to 128K with YaRN; the phase's
``rope_type``, docs/k2_reference.md).

:func:`rope_fields` gives the fields :func:`k2.model.build.transformer_config` builds the config with;
:func:`set_rope_type` sets them on built model chunks in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k2.config.choices import RopeType, allowed, values

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig


def rope_fields(model_cfg: ModelConfig, rope_type: str) -> dict:
    """megatron ``MLATransformerConfig`` RoPE fields for ``rope_type`` (``rope`` | ``yarn``).

    megatron's MLA multiplies the softmax scale by ``yarn_mscale(rotary_scaling_factor, mscale_all_dim)^2``
    even when ``rope_type == "rope"``. K2 pretrains at 4K with plain RoPE (YaRN only for the 128K
    extension), so the YaRN factor (``k2.model.rotary_scaling_factor``) is only passed when YaRN is on
    (1.0 otherwise, which makes that mscale 1); the recipe keeps the YaRN numbers for that phase.
    """
    if rope_type not in values(RopeType):
        raise ValueError(f"rope_type={rope_type!r}; allowed: {allowed(RopeType)}")
    return dict(
        rope_type=str(rope_type),  # megatron's config keeps the plain string
        rotary_base=model_cfg.rotary_base,
        rotary_scaling_factor=float(model_cfg.rotary_scaling_factor) if rope_type == "yarn" else 1.0,
        original_max_position_embeddings=model_cfg.original_max_position_embeddings,
        beta_fast=model_cfg.beta_fast,
        beta_slow=model_cfg.beta_slow,
        mscale=model_cfg.mscale,
        mscale_all_dim=model_cfg.mscale_all_dim,
    )


def set_rope_type(chunks: list, tcfg, model_cfg: ModelConfig, rope_type: str) -> int:
    """Switch every MLA layer of ``chunks`` to ``rope_type`` in place (a schedule phase boundary).

    megatron's ``MLASelfAttention.__init__`` builds ``rotary_pos_emb`` (``RotaryEmbedding`` for
    ``rope``, ``YarnRotaryEmbedding`` for ``yarn``) and ``softmax_scale`` =
    ``yarn_mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``
    from the config once, and its forward reads ``config.rope_type``. This sets the RoPE fields of
    :func:`rope_fields` on ``tcfg`` (and on each layer's config), rebuilds each layer's rotary module with
    the same constructor call megatron uses, and sets the new softmax scale on the layer and on its core
    attention (:class:`k2.model.attention.K2CoreAttention` keeps its own copy, used by the softmax and the
    max-logit record). The rotary modules hold no parameters, so the optimizer and DDP are unaffected.

    Args:
        chunks: model chunks (``GPTModel`` or wrapped).
        tcfg: the run's ``MLATransformerConfig``.
        model_cfg: ``cfg.model`` (RoPE/YaRN numbers).
        rope_type: ``rope`` | ``yarn``.

    Returns:
        number of attention layers switched.

    Raises:
        ValueError: an unknown ``rope_type``.
    """
    import math

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        _yarn_get_mscale,
    )
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    fields = rope_fields(model_cfg, rope_type)
    for k, v in fields.items():
        setattr(tcfg, k, v)
    count = 0
    for chunk in chunks:
        for mod in chunk.modules():
            if not isinstance(mod, MultiLatentAttention):
                continue
            c = mod.config
            for k, v in fields.items():
                setattr(c, k, v)
            cp_group = mod.pg_collection.cp
            if rope_type == "rope":
                mod.rotary_pos_emb = RotaryEmbedding(
                    c.qk_pos_emb_head_dim,
                    rotary_percent=c.rotary_percent,
                    rotary_base=c.rotary_base,
                    cp_group=cp_group,
                )
            else:
                mod.rotary_pos_emb = YarnRotaryEmbedding(
                    c.qk_pos_emb_head_dim,
                    rotary_base=c.rotary_base,
                    scaling_factor=c.rotary_scaling_factor,
                    original_max_position_embeddings=c.original_max_position_embeddings,
                    beta_fast=c.beta_fast,
                    beta_slow=c.beta_slow,
                    mscale=c.mscale,
                    mscale_all_dim=c.mscale_all_dim,
                    cp_group=cp_group,
                )
            mscale = _yarn_get_mscale(c.rotary_scaling_factor, c.mscale_all_dim)
            mod.softmax_scale = mscale * mscale / math.sqrt(mod.q_head_dim)
            mod.core_attention.softmax_scale = mod.softmax_scale
            count += 1
    return count
