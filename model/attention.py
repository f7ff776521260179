"""Project-owned core attention for MLA: different q/k and v head dims, per-head max-logit recording.

Why our own module (docs/k2_reference.md, "Open anchors"): megatron-core's local ``DotProductAttention`` rejects
MLA's ``k_channels``/``v_channels`` (qk 192 / v 128 for K2), and megatron gets per-head max logits for
QK-Clip only from Transformer Engine >= 2.9. This module

* computes softmax(scale * q k^T + causal mask) v for q, k of head dim ``k_channels`` and v of
  ``v_channels``,
* records, in training forwards, the running per-head maximum of the pre-softmax logit
  ``scale * q_i . k_j`` over unmasked (i, j) and over all microbatches since the last
  :meth:`K2CoreAttention.reset_max_logits` (QK-Clip, K2 report section 2.1 / MuonClip),
* has two backends (``k2.model.attention_backend``; ``auto`` = ``sdpa`` on CUDA, ``eager`` on CPU):

  - ``sdpa``: a fused kernel through ``torch.nn.functional.scaled_dot_product_attention``, on CUDA with
    cuDNN first in the priority list (cuDNN SDPA has a kernel for qk 192 / v 128; flash does not; the
    memory-efficient kernel is ~9x slower), and the max logits from a separate no-grad chunked
    ``q k^T`` pass (:func:`per_head_max_logit`: ``b x heads x chunk x s`` scores at a time, max taken in
    the compute dtype). It runs on CPU too (torch's CPU SDPA), so the CPU tests exercise this path's
    logic;
  - ``eager``: one explicit pass (scores materialised in the compute dtype, softmax in fp32) that yields
    both the output and the max logits.

  Both record the same max logits: the maximum of ``scale * (q_i . k_j)`` equals ``scale * max(q_i . k_j)``
  exactly in floating point (rounding is monotonic and the scale positive).

With Transformer Engine (``te``, only when set explicitly: :func:`te_core_attention_class`): megatron's
``TEDotProductAttention`` with TE's ``return_max_logit`` (TE >= 2.9), exposed under this module's
``max_logits`` interface and recording rule.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from k2.model.fp32_buffers import fp32_buffer
from k2.model.recompute import recomputing

# Query rows per chunk in the GPU max-logit pass: bounds its extra memory to
# b * heads * chunk * s_k fp32 values.
MAX_LOGIT_CHUNK = 1024


def per_head_max_logit(
    query: torch.Tensor,
    key: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    attention_mask: torch.Tensor | None = None,
    chunk: int = MAX_LOGIT_CHUNK,
) -> torch.Tensor:
    """Per-head max of ``softmax_scale * q_i . k_j`` over batch and unmasked positions.

    Args:
        query: ``[b, np, sq, hk]``.
        key: ``[b, np, sk, hk]``.
        softmax_scale: the scale used by the softmax (MLA: ``mscale^2 / sqrt(qk_head_dim + rope_dim)``).
        causal: mask ``j > i`` (aligned to the end when ``sk > sq``).
        attention_mask: optional boolean ``[b or 1, 1 or np, sq, sk]``, True = masked out (megatron's
            convention); combined with ``causal``.
        chunk: query rows per block (memory bound).

    Returns:
        ``[np]`` fp32 tensor; ``-inf`` for a head that saw no unmasked position.
    """
    b, np_, sq, _ = query.shape
    sk = key.shape[2]
    out = torch.full((np_,), float("-inf"), device=query.device, dtype=torch.float32)

    def block_max(q_blk, k_blk, mask=None):
        # max in the compute dtype, then one fp32 conversion and scaling per head: a positive scale
        # commutes with max, and converting/scaling whole [b, np, rows, cols] blocks in fp32 cost
        # ~10x the attention kernel itself on an H200 (bench=attention).
        scores = torch.matmul(q_blk, k_blk.transpose(-1, -2))
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        return scores.amax(dim=(0, 2, 3)).float() * softmax_scale

    for start in range(0, sq, chunk):
        stop = min(sq, start + chunk)
        q_blk = query[:, :, start:stop]
        if attention_mask is not None or not causal:
            mask = None
            if attention_mask is not None:
                mask = attention_mask[..., start:stop, :]
            if causal:
                rows = torch.arange(start, stop, device=query.device).unsqueeze(1) + (sk - sq)
                cmask = torch.arange(sk, device=query.device).unsqueeze(0) > rows
                mask = cmask if mask is None else (mask | cmask)
            out = torch.maximum(out, block_max(q_blk, key, mask))
            continue
        # causal, no explicit mask: keys before the block's first row are visible to every row (no
        # mask needed); only the diagonal block needs the triangle; keys after it are never visible.
        past = max(0, start + (sk - sq))
        diag_end = min(sk, stop + (sk - sq))
        if past > 0:
            out = torch.maximum(out, block_max(q_blk, key[:, :, :past]))
        if diag_end > past:
            rows = torch.arange(start, stop, device=query.device).unsqueeze(1) + (sk - sq)
            cols = torch.arange(past, diag_end, device=query.device).unsqueeze(0)
            out = torch.maximum(out, block_max(q_blk, key[:, :, past:diag_end], cols > rows))
    return out


def cuda_sdpa_backends() -> list:
    """SDPA kernels the sdpa backend may run on CUDA, in priority order: cuDNN (it has a kernel for MLA's
    qk 192 / v 128 head dims), flash, memory-efficient. Not torch's MATH fallback: it materialises the
    ``[b, heads, s, s]`` scores and probabilities (K2 at 32K tokens: 128 GiB per layer in BF16), which no
    plan counts, ~10x slower; a shape no fused kernel takes fails instead (:func:`fused_sdpa`)."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def fused_sdpa(sdpa):
    """``sdpa()`` (a bound ``scaled_dot_product_attention`` call) restricted to :func:`cuda_sdpa_backends`.

    Raises:
        RuntimeError: no fused kernel takes these inputs (torch's reasons are in its warnings); names the
            settings that avoid it.
    """
    from torch.nn.attention import sdpa_kernel

    try:
        with sdpa_kernel(cuda_sdpa_backends(), set_priority=True):
            return sdpa()
    except RuntimeError as e:
        if "No available kernel" not in str(e):
            raise
        raise RuntimeError(
            "model.attention_backend=sdpa: no fused attention kernel (cuDNN, flash, "
            "memory-efficient) takes these inputs (torch's warnings above say why), and the "
            "unfused MATH kernel is not used (it materialises every score); allowed: "
            "model.attention_backend=eager (explicit scores, planned as such) or inputs a "
            "fused kernel takes"
        ) from e


def records_max_logits(module) -> bool:
    """The max-logit rule of every core attention (:class:`K2CoreAttention`, the TE adapter): a forward
    adds to the running max that QK-Clip reads only when ``module.record_max_logits`` is set, in training
    (evaluation forwards between two optimizer steps must not decide the next clip), and once per forward
    (not again when whole-layer recompute re-runs the layer in backward, :func:`k2.model.recompute.recomputing`)."""
    return bool(module.record_max_logits) and module.training and not recomputing()


class K2CoreAttention(MegatronModule):
    """Core attention (the part after the q/k/v projections) for MLA and MHA/GQA.

    Built by megatron's ``MLASelfAttention`` through the layer spec with megatron's core-attention
    signature. ``forward`` takes ``query [sq, b, np, hk]``, ``key [sk, b, ng, hk]``,
    ``value [sk, b, ng, hv]`` and returns ``[sq, b, np * hv]``.

    Attributes:
        max_logits: ``[np]`` fp32 buffer (non-persistent): running per-head max pre-softmax logit of
            training forwards since the last :meth:`reset_max_logits`; ``-inf`` before any.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        record_max_logits: bool = True,
        backend: str = "auto",
        max_logit_kernel: str = "torch",
    ):
        super().__init__(config=config)
        if backend not in ("auto", "sdpa", "eager"):
            raise ValueError(f"K2CoreAttention backend={backend!r}; allowed: auto, sdpa, eager")
        if max_logit_kernel not in ("torch", "triton"):
            raise ValueError(f"K2CoreAttention max_logit_kernel={max_logit_kernel!r}; allowed: torch, triton")
        self.backend = backend
        self.max_logit_kernel = max_logit_kernel
        if config.context_parallel_size != 1:
            raise ValueError("K2CoreAttention does not implement context parallelism (cp must be 1)")
        tp_size = pg_collection.tp.size() if pg_collection is not None else 1
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = config.num_attention_heads // tp_size
        self.num_query_groups = (config.num_query_groups or config.num_attention_heads) // tp_size
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.record_max_logits = record_max_logits
        self.register_buffer(
            "max_logits",
            torch.full((self.num_heads,), float("-inf"), dtype=torch.float32),
            persistent=False,
        )

    def _max_logit(self, q, k, causal: bool, mask) -> torch.Tensor:
        """The sdpa path's per-head max logit ``[np]``: the Triton kernel (``max_logit_kernel=triton``,
        no explicit mask, where it runs) or the chunked torch pass."""
        if self.max_logit_kernel == "triton" and mask is None:
            from k2.model.max_logit_kernel import available, per_head_max_logit_triton

            if available(q.device):
                return per_head_max_logit_triton(q, k, self.softmax_scale, causal)
        return per_head_max_logit(q, k, self.softmax_scale, causal, mask)

    def reset_max_logits(self) -> None:
        """Start a new max-logit window (called by the train loop after each optimizer step)."""
        self.max_logits.fill_(float("-inf"))

    def _record(self, logits_max: torch.Tensor) -> None:
        # fp32 on the logits' device, whatever the BF16 wrapper did to the buffer (model/fp32_buffers.py)
        buf = fp32_buffer(self, "max_logits", logits_max.device)
        torch.maximum(buf, logits_max.float(), out=buf)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """Attention output ``[sq, b, np * hv]`` (see class docstring for input shapes).

        Raises:
            ValueError: packed sequences (THD) or an attention bias, which this module does not take.
        """
        if packed_seq_params is not None:
            raise ValueError("K2CoreAttention does not support packed sequences (THD)")
        if attention_bias is not None:
            raise ValueError("K2CoreAttention does not support an attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        sq, b = query.shape[0], query.shape[1]
        rep = self.num_heads // key.shape[2]
        if rep > 1:  # GQA: repeat k/v groups to the query heads
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hk]
        k = key.permute(1, 2, 0, 3)  # [b, np, sk, hk]
        v = value.permute(1, 2, 0, 3)  # [b, np, sk, hv]
        mask = attention_mask if attention_mask is not None and not causal else None
        record = records_max_logits(self)
        dropout = self.dropout_p if self.training else 0.0

        backend = self.backend if self.backend != "auto" else ("sdpa" if q.is_cuda else "eager")
        if backend == "sdpa":
            sdpa = partial(
                F.scaled_dot_product_attention,
                q,
                k,
                v,
                attn_mask=None if mask is None else ~mask,
                dropout_p=dropout,
                is_causal=causal and mask is None,
                scale=self.softmax_scale,
            )
            ctx = fused_sdpa(sdpa) if q.is_cuda else sdpa()
            if record:
                with torch.no_grad():
                    self._record(self._max_logit(q, k, causal, mask))
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale  # [b, np, sq, sk]
            masked = None
            if causal:
                sk = k.shape[2]
                rows = torch.arange(sq, device=q.device).unsqueeze(1) + (sk - sq)
                masked = torch.arange(sk, device=q.device).unsqueeze(0) > rows
            if mask is not None:
                masked = mask if masked is None else (mask | masked)
            if masked is not None:
                scores = scores.masked_fill(masked, float("-inf"))
            if record:
                with torch.no_grad():
                    self._record(scores.detach().amax(dim=(0, 2, 3)).float())
            probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
            if dropout > 0:
                probs = F.dropout(probs, p=dropout)
            ctx = torch.matmul(probs, v)  # [b, np, sq, hv]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * v.shape[-1])


_TE_CLASS = None


def te_core_attention_class():
    """:class:`K2TEDotProductAttention` (:func:`te_adapter` over megatron's ``TEDotProductAttention``:
    Transformer Engine's fused attention; needs TE >= 2.9 for ``return_max_logit``). Built on first use
    (TE is optional). The model config must have ``log_max_attention_logit=True`` (``model/build.py`` sets
    it), which makes megatron request the max logit from TE and keep the running max in
    ``current_max_attn_logits``.

    Never the default (``model.attention_backend=auto`` resolves to ``sdpa`` on CUDA, :mod:`k2.model.backends`):
    TE's fused attention has not run in this project; the adapter's max-logit rule is tested with a
    stand-in base class (tests/unit/model/test_attention.py), the TE case itself runs where TE is installed.
    """
    global _TE_CLASS
    if _TE_CLASS is None:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        _TE_CLASS = te_adapter(TEDotProductAttention)
    return _TE_CLASS


def te_adapter(base):
    """``base`` (megatron's ``TEDotProductAttention``, or a stand-in with its max-logit bookkeeping: a
    ``current_max_attn_logits`` running max that every forward updates) with :class:`K2CoreAttention`'s
    max-logit interface (``max_logits``, ``reset_max_logits``, ``num_heads``, ``record_max_logits``) and its
    rule (:func:`records_max_logits`): megatron's module updates the running max in every forward,
    evaluation and recompute re-runs included; here those forwards leave it as it was."""

    class K2TEDotProductAttention(base):
        is_k2_max_logit_attention = True

        def __init__(
            self,
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=None,
            softmax_scale=None,
            k_channels=None,
            v_channels=None,
            cp_comm_type="p2p",
            pg_collection=None,
            record_max_logits: bool = True,
            backend: str = "te",
        ):
            if not (config.log_max_attention_logit or config.qk_clip):
                raise ValueError("K2TEDotProductAttention needs config.log_max_attention_logit=True")
            super().__init__(
                config,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                k_channels=k_channels,
                v_channels=v_channels,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )
            tp = pg_collection.tp.size() if pg_collection is not None else 1
            self.num_heads = config.num_attention_heads // tp
            self.record_max_logits = record_max_logits
            self.k2_softmax_scale = softmax_scale

        def forward(self, *args, **kwargs):
            """megatron's forward; its update of the running max is undone when this forward must not
            record (:func:`records_max_logits`)."""
            kept = self.current_max_attn_logits
            out = super().forward(*args, **kwargs)
            if not records_max_logits(self):
                self.current_max_attn_logits = kept
            return out

        @property
        def max_logits(self) -> torch.Tensor:
            """``[np]`` fp32 running max since the last reset (``-inf`` before any forward)."""
            m = self.current_max_attn_logits
            if m is None:
                dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
                return torch.full((self.num_heads,), float("-inf"), dtype=torch.float32, device=dev)
            return m.float().reshape(-1)

        def reset_max_logits(self) -> None:
            self.current_max_attn_logits = None

    return K2TEDotProductAttention


def is_max_logit_attention(module) -> bool:
    """True for a core attention that records per-head max logits (:class:`K2CoreAttention` or the TE
    adapter of :func:`te_core_attention_class`)."""
    return isinstance(module, K2CoreAttention) or getattr(module, "is_k2_max_logit_attention", False)
