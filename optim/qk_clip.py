"""QK-Clip (K2 report section 2.1, "MuonClip", Algorithm 1; docs/k2_reference.md "Optimizer").

After each optimizer step, for every attention head ``h`` with the largest pre-softmax logit of the step
``S_h = max scale * q_i . k_j`` (over all microbatches, positions and data-parallel ranks; ``scale`` the
softmax scale the attention used) above ``tau``, take ``gamma_h = tau / S_h`` and rescale the weights
that make the head's queries and keys so that the head's logits shrink by exactly ``gamma_h``:

* MLA (megatron ``MLASelfAttention``): ``linear_q_up_proj`` (or ``linear_q_proj`` without a q LoRA)
  stores per head ``[q_nope (qk_head_dim rows); q_rope (qk_pos_emb_head_dim rows)]``, and
  ``linear_kv_up_proj`` per head ``[k_nope (qk_head_dim rows); v (v_head_dim rows)]`` (megatron's
  ``q.view(..., heads, qk + rope)`` and ``kv.view(..., heads, qk + v)`` splits). ``q_nope`` and ``k_nope``
  rows are scaled by ``sqrt(gamma_h)``, ``q_rope`` rows by ``gamma_h``; the rotary key ``k_R`` (rows of
  ``linear_kv_down_proj``) is shared by all heads and not scaled; the values are not scaled.
* MHA/GQA (megatron ``SelfAttention``, fused ``linear_qkv`` stored per query group as ``[q of the group's
  r heads; k; v]``): with ``gamma_g = min`` over the heads of group ``g``, the group's ``k`` rows are
  scaled by ``sqrt(gamma_g)`` and each head's ``q`` rows by ``gamma_h / sqrt(gamma_g)``; for MHA
  (``r = 1``) that is ``sqrt(gamma_h)`` on both, K2's rule, and for GQA each head's logits still scale by
  exactly ``gamma_h``.

Heads with ``S_h <= tau`` -- including a negative or zero max, and heads that saw no position
(``-inf``) -- get ``gamma_h = 1`` and are untouched. Both the model weight and the optimizer's fp32 master
copy (megatron's ``param.main_param``: whole, or this rank's byte range of it under the distributed
optimizer) are scaled, so the next step starts from the clipped weights.

Why ours (``megatron/core/optimizer/qk_clip.py`` + ``MLASelfAttention.clip_qk`` in megatron-core 0.19.2):
they read Transformer Engine's max logits, walk ``model_chunk.module.module`` (DDP -> Float16Module ->
GPTModel only), compute ``(tau / S)^0.5`` without guarding ``S <= 0`` (a negative max gives NaN weights),
and reshape ``main_param`` as the whole weight (wrong for the distributed optimizer's flat shard).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k2.model.attention import is_max_logit_attention
from k2.optim.build import leaf_optimizers


def clip_factors(max_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """``gamma = tau / S`` where ``S > tau``, else 1 (negative, zero, ``-inf``, NaN: 1).

    Args:
        max_logits: per-head max pre-softmax logits ``S``, any shape.
        tau: threshold (> 0).

    Returns:
        fp32 tensor of the same shape, values in ``(0, 1]``.
    """
    s = max_logits.float()
    return torch.where(s > tau, tau / torch.where(s > tau, s, torch.ones_like(s)), torch.ones_like(s))


def mla_row_scales(
    gamma: torch.Tensor, qk_head_dim: int, qk_pos_emb_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row factors for megatron's MLA up-projections.

    Args:
        gamma: ``[heads]`` clip factors.
        qk_head_dim, qk_pos_emb_head_dim, v_head_dim: MLA head dims (nope, rope, value).

    Returns:
        ``(q_rows [heads * (nope + rope)], kv_rows [heads * (nope + v)])``: ``sqrt(gamma)`` on q_nope and
        k_nope rows, ``gamma`` on q_rope rows, 1 on value rows.
    """
    g = gamma.float().view(-1, 1)
    root = g.sqrt()
    q = torch.cat([root.expand(-1, qk_head_dim), g.expand(-1, qk_pos_emb_head_dim)], dim=1)
    kv = torch.cat([root.expand(-1, qk_head_dim), torch.ones_like(g).expand(-1, v_head_dim)], dim=1)
    return q.reshape(-1), kv.reshape(-1)


def qkv_row_scales(gamma: torch.Tensor, num_query_groups: int, head_dim: int) -> torch.Tensor:
    """Per-row factors for megatron's fused ``linear_qkv`` (MHA/GQA; see the module docstring).

    Args:
        gamma: ``[heads]`` clip factors, heads in megatron's order (group-major).
        num_query_groups: key/value heads (= heads for MHA).
        head_dim: ``kv_channels``.

    Returns:
        ``[num_query_groups * (heads / groups + 2) * head_dim]``.
    """
    g = gamma.float().view(num_query_groups, -1)  # [groups, r]
    g_grp = g.min(dim=1, keepdim=True).values  # [groups, 1]
    q = (g / g_grp.sqrt()).unsqueeze(-1).expand(-1, -1, head_dim).reshape(num_query_groups, -1)
    k = g_grp.sqrt().expand(-1, head_dim)
    v = torch.ones_like(k)
    return torch.cat([q, k, v], dim=1).reshape(-1)


@dataclass
class _Layer:
    number: int  # global 1-based layer number
    core: object  # model.attention.K2CoreAttention
    scales: callable  # gamma [heads] -> list of per-row factor tensors, one per weight
    weights: list  # the parameters scaled, in the order of ``scales``' output


class QKClip:
    """QK-Clip over this rank's model chunks (see the module docstring), plus the max-logit metrics.

    Args:
        model: this rank's model chunks (DDP-wrapped or not); their core attention must be
            :class:`k2.model.attention.K2CoreAttention` recording max logits.
        optimizer: the megatron optimizer (its master copies are scaled too); None = weights only.
        tau: threshold; None = only report the max logits (and reset the windows).
        num_layers: total decoder layers of the model (for the per-layer table).

    Raises:
        ValueError: an attention module QK-Clip cannot rescale (q/k layer norm after the projections in a
            non-MLA attention, tensor parallelism).
    """

    def __init__(self, model: list, optimizer, tau: float | None, num_layers: int):
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention

        self.tau = tau
        self.num_layers = num_layers
        self.layers: list[_Layer] = []
        self.num_heads = 0
        for chunk in model:
            for mod in chunk.modules():
                core = getattr(mod, "core_attention", None)
                if not is_max_logit_attention(core):
                    continue
                cfg = mod.config
                if cfg.tensor_model_parallel_size != 1:
                    raise ValueError("QK-Clip: tensor parallelism is not supported (parallel.tp must be 1)")
                self.num_heads = max(self.num_heads, core.num_heads)
                if isinstance(mod, MLASelfAttention):
                    if not math.isclose(core.softmax_scale, mod.softmax_scale):
                        raise ValueError("QK-Clip: core attention and MLA softmax scales differ")
                    q_w = (mod.linear_q_up_proj if cfg.q_lora_rank is not None else mod.linear_q_proj).weight
                    dims = (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim)
                    self.layers.append(
                        _Layer(
                            mod.layer_number,
                            core,
                            lambda g, d=dims: list(mla_row_scales(g, *d)),
                            [q_w, mod.linear_kv_up_proj.weight],
                        )
                    )
                else:
                    for norm in ("q_layernorm", "k_layernorm"):
                        n = getattr(mod, norm, None)
                        if n is not None and any(True for _ in n.parameters()):
                            raise ValueError(
                                f"QK-Clip: {norm} after the q/k projection would undo the weight scaling; "
                                "set optim.qk_clip_tau=null or turn the q/k layer norm off"
                            )
                    groups = mod.num_query_groups_per_partition
                    hd = mod.hidden_size_per_attention_head
                    self.layers.append(
                        _Layer(
                            mod.layer_number,
                            core,
                            lambda g, n=groups, d=hd: [qkv_row_scales(g, n, d)],
                            [mod.linear_qkv.weight],
                        )
                    )
        self._masters = {}
        for layer in self.layers:
            for w in layer.weights:
                self._masters[id(w)] = self._master_of(optimizer, w)

    @staticmethod
    def _master_of(optimizer, p) -> tuple | None:
        """``(master tensor, start, end)`` of ``p``'s fp32 master copy; ``start`` is None for a whole copy;
        None when the optimizer steps ``p`` itself (fp32, no copy) or this rank holds no copy."""
        main = getattr(p, "main_param", None)
        if main is None or main is p:
            return None
        if not getattr(p, "main_param_sharded", False):
            return main, None, None
        for leaf in leaf_optimizers(optimizer):
            gbuf_map = getattr(leaf, "model_param_gbuf_map", None)
            if gbuf_map is not None and p in gbuf_map:
                rng = leaf._get_model_param_range_map(p)["param"]
                return main, rng.start, rng.end
        raise ValueError("QK-Clip: a sharded master copy without its distributed optimizer")

    @torch.no_grad()
    def _scale(self, p: torch.Tensor, rows: torch.Tensor) -> None:
        rows = rows.to(p.device).view(-1, 1)
        p.data.copy_((p.data.float() * rows).to(p.dtype))
        master = self._masters.get(id(p))
        if master is None:
            return
        main, start, end = master
        # (the master copy may live in host memory between steps: optim.offload_fraction)
        if start is None:
            main.mul_(rows.to(main.device, main.dtype))
        else:
            main.mul_(rows.expand(p.shape).reshape(-1)[start:end].to(main.device, main.dtype))

    @torch.no_grad()
    def step(self, apply: bool = True) -> dict:
        """Reduce the step's max logits, clip (when ``tau`` is set and ``apply``), reset the windows.

        Collective over all ranks (one all-reduce of ``[num_layers, heads]``).

        Args:
            apply: False after a skipped update (metrics and reset only).

        Returns:
            ``{"max_attn_logit": float or None, "max_attn_logit_per_layer": [float or None] * num_layers,
            "qk_clipped_heads": int}`` -- the max over heads/positions/microbatches/DP ranks of the
            pre-softmax logits of this step's forwards; None where nothing was recorded.
        """
        import torch.distributed as dist

        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        heads = max(1, self.num_heads)
        table = torch.full((self.num_layers, heads), float("-inf"), device=dev)
        for layer in self.layers:
            row = layer.core.max_logits.to(dev).float()
            table[layer.number - 1, : row.numel()] = torch.maximum(table[layer.number - 1, : row.numel()], row)
        if dist.is_initialized():
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        for layer in self.layers:
            layer.core.reset_max_logits()
        clipped = 0
        if self.tau is not None:
            clipped = int((table > self.tau).sum().item())
            if apply and clipped:
                for layer in self.layers:
                    gamma = clip_factors(table[layer.number - 1, : layer.core.num_heads], self.tau)
                    if bool((gamma < 1).any()):
                        for w, rows in zip(layer.weights, layer.scales(gamma)):
                            self._scale(w, rows)
        per_layer = [v if math.isfinite(v) else None for v in table.max(dim=1).values.tolist()]
        finite = [v for v in per_layer if v is not None]
        return {
            "max_attn_logit": max(finite) if finite else None,
            "max_attn_logit_per_layer": per_layer,
            "qk_clipped_heads": clipped,
        }
