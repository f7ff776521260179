"""Model FLOPs of a K2-family model (MLA + MoE) and MFU: one implementation for ``k2-plan`` and ``k2-train``.

Counting convention (the one of Megatron-LM's ``num_floating_point_operations``, PaLM appendix B and
Korthikanti et al. 2022): a ``[m, k] x [k, n]`` matrix product costs ``2 m k n`` FLOPs (multiply + add);
element-wise work (norms, SwiGLU, softmax, RoPE, residual adds) and the embedding lookup count 0; the
backward pass of every matrix product costs twice its forward (input gradient + weight gradient), so one
training step costs **3 x forward**. Recomputed activations are *not* model FLOPs (they are hardware
FLOPs): MFU is model FLOPs per second over peak.

Forward FLOPs per token (``h`` hidden, ``H`` heads, ``d_qk`` / ``d_r`` / ``d_v`` the qk "nope" / rope / v
head dims, ``r_q`` / ``r_kv`` the q / kv LoRA ranks, ``s`` the sequence length, ``E`` routed experts,
``k`` top-k, ``f`` / ``f_e`` / ``f_s`` the dense / expert / shared-expert FFN widths, ``V`` the vocab):

* MLA projections, per layer: ``2 [h r_q + r_q H (d_qk + d_r) + h (r_kv + d_r) + r_kv H (d_qk + d_v)
  + H d_v h]`` (q down / q up / kv down incl. the shared rope key / kv up / output projection; without
  a q LoRA the q terms are ``h H (d_qk + d_r)``);
* causal core attention, per layer: ``2 H (d_qk + d_r) s/2 + 2 H d_v s/2`` (``q k^T`` and ``p v``; a
  query attends on average to ``s/2`` keys, megatron's convention; exactly ``(s+1)/2``);
* dense SwiGLU FFN, per dense layer: ``2 x 3 h f`` (gate, up, down);
* router, per MoE layer: ``2 h E``;
* routed experts, per MoE layer: ``k x 2 x 3 h f_e`` (only the top-k experts a token visits);
* shared expert, per MoE layer: ``2 x 3 h f_s``;
* LM head: ``2 h V``.

Kimi K2 at ``s = 4096`` (tests/unit/model/test_flops.py checks each term): forward 68.49 GFLOP per token = MLA
projections 12.34 + core attention 5.12 + dense FFN 0.79 + router 0.33 + routed experts 42.28 + shared
expert 5.28 + LM head 2.35; training 205.47 GFLOP per token (about 6 x 32.9B active parameters, minus the
embedding lookup, plus attention); one 67,108,864-token global batch costs 1.379e19 FLOPs.

Compared with Megatron-LM's ``megatron.training.training.num_floating_point_operations`` (shipped in the
megatron-core wheel; ``tests/unit/model/test_flops.py`` calls it): the same terms, except that megatron also counts
``6 (r_q + r_kv)`` per layer and token for the q/kv latent RMSNorms and does *not* count the router
(``2 h E``). Nothing else in megatron-core counts FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig

__all__ = ["FlopsPerToken", "flops_per_token", "mfu", "step_flops"]

#: Training FLOPs = this x forward FLOPs (backward = input gradient + weight gradient = 2 x forward).
TRAINING_FACTOR = 3


def _moe_pattern(model_cfg: ModelConfig) -> list[int]:
    n, k = int(model_cfg.num_layers), int(model_cfg.first_k_dense_replace)
    if not model_cfg.num_moe_experts:
        return [0] * n
    if not 0 <= k <= n:
        raise ValueError(f"model.first_k_dense_replace={k} must be in [0, model.num_layers={n}]")
    return [0] * k + [1] * (n - k)


@dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs per token of one model at one sequence length, per term (see the module docstring).

    Per-layer fields are for ONE layer of that kind; the ``*_total`` properties sum over the layers.

    Attributes:
        seq_length: tokens per sequence the attention term is for.
        attention_proj: MLA projections of one layer.
        attention_up_proj: the q and kv up-projections among them (what ``memory.recompute=[mla_up_proj]``
            recomputes in the backward).
        attention_core: causal ``q k^T`` and ``p v`` of one layer at ``seq_length``.
        dense_mlp: SwiGLU FFN of one dense layer.
        router: router GEMM of one MoE layer.
        routed_experts: the top-k routed experts of one MoE layer (per token).
        shared_experts: the shared expert(s) of one MoE layer.
        lm_head: output projection to the vocabulary.
        moe_pattern: per layer 0 = dense, 1 = MoE.
    """

    seq_length: int
    attention_proj: int
    attention_up_proj: int
    attention_core: float
    dense_mlp: int
    router: int
    routed_experts: int
    shared_experts: int
    lm_head: int
    moe_pattern: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.moe_pattern)

    def layer(self, i: int) -> float:
        """Forward FLOPs per token of global 0-based layer ``i``."""
        attn = self.attention_proj + self.attention_core
        if self.moe_pattern[i]:
            return attn + self.router + self.routed_experts + self.shared_experts
        return attn + self.dense_mlp

    def layer_gemm(self, i: int) -> int:
        """Forward FLOPs per token of the weight GEMMs of layer ``i`` (everything but core attention):
        the part whose backward splits into an input gradient and a weight gradient of the same size."""
        if self.moe_pattern[i]:
            return self.attention_proj + self.router + self.routed_experts + self.shared_experts
        return self.attention_proj + self.dense_mlp

    @property
    def forward(self) -> float:
        """Forward FLOPs per token of the whole model (all layers + LM head)."""
        return sum(self.layer(i) for i in range(self.num_layers)) + self.lm_head

    @property
    def training(self) -> float:
        """Training FLOPs per token: ``3 x forward``."""
        return TRAINING_FACTOR * self.forward

    def terms(self) -> dict[str, float]:
        """Forward FLOPs per token summed over the model, per term (keys as in the module docstring)."""
        nd = self.moe_pattern.count(0)
        nm = self.moe_pattern.count(1)
        return {
            "mla_projections": self.num_layers * self.attention_proj,
            "core_attention": self.num_layers * self.attention_core,
            "dense_mlp": nd * self.dense_mlp,
            "router": nm * self.router,
            "routed_experts": nm * self.routed_experts,
            "shared_experts": nm * self.shared_experts,
            "lm_head": self.lm_head,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq_length": self.seq_length,
            "forward_per_token": self.forward,
            "training_per_token": self.training,
            "forward_terms_per_token": self.terms(),
        }


def flops_per_token(model_cfg: ModelConfig, seq_length: int) -> FlopsPerToken:
    """Forward FLOPs per token of ``model_cfg`` at ``seq_length`` (formula in the module docstring).

    Args:
        model_cfg: ``cfg.model`` (:class:`k2.config.schema.ModelConfig` keys).
        seq_length: tokens per sequence (sets the causal-attention term).

    Returns:
        :class:`FlopsPerToken`.

    Raises:
        ValueError: ``seq_length < 1`` or ``k2.model.first_k_dense_replace`` out of range.
    """
    if int(seq_length) < 1:
        raise ValueError(f"seq_length={seq_length} must be >= 1")
    m = model_cfg
    h, H = int(m.hidden_size), int(m.num_attention_heads)
    d_qk, d_r, d_v = int(m.qk_head_dim), int(m.qk_pos_emb_head_dim), int(m.v_head_dim)
    r_q, r_kv = m.q_lora_rank, int(m.kv_lora_rank)
    q = h * r_q + r_q * H * (d_qk + d_r) if r_q else h * H * (d_qk + d_r)
    kv = h * (r_kv + d_r) + r_kv * H * (d_qk + d_v)
    proj = 2 * (q + kv + H * d_v * h)
    up = 2 * ((r_q * H * (d_qk + d_r) if r_q else 0) + r_kv * H * (d_qk + d_v))
    core = 2 * H * (d_qk + d_r) * seq_length / 2 + 2 * H * d_v * seq_length / 2
    E = int(m.num_moe_experts or 0)
    topk = int(m.moe_router_topk) if E else 0
    f_e = int(m.moe_ffn_hidden_size or 0) if E else 0
    f_s = int(m.moe_shared_expert_intermediate_size or 0) if E else 0
    return FlopsPerToken(
        seq_length=int(seq_length),
        attention_proj=proj,
        attention_up_proj=up,
        attention_core=core,
        dense_mlp=2 * 3 * h * int(m.ffn_hidden_size),
        router=2 * h * E,
        routed_experts=topk * 2 * 3 * h * f_e,
        shared_experts=2 * 3 * h * f_s,
        lm_head=2 * h * int(m.vocab_size),
        moe_pattern=tuple(_moe_pattern(model_cfg)),
    )


def step_flops(model_cfg: ModelConfig, seq_length: int, tokens: int) -> float:
    """Model FLOPs of one training step of ``tokens`` tokens at ``seq_length``: ``3 x forward x tokens``."""
    return flops_per_token(model_cfg, seq_length).training * int(tokens)


def mfu(flops: float, seconds: float, num_gpus: int, peak_tflops: float) -> tuple[float, float]:
    """Model TFLOP/s per GPU and MFU of a step.

    Args:
        flops: model FLOPs of the step (:func:`step_flops`).
        seconds: measured wall time of the step.
        num_gpus: devices that ran it (the world size).
        peak_tflops: dense BF16 peak of one device in TFLOP/s (``cluster.peak_tflops``).

    Returns:
        ``(tflops_per_gpu, mfu)``: achieved model TFLOP/s per device and its fraction of the peak.

    Raises:
        ValueError: a non-positive ``seconds``, ``num_gpus`` or ``peak_tflops``.
    """
    if seconds <= 0 or num_gpus < 1 or peak_tflops <= 0:
        raise ValueError(
            f"mfu needs seconds > 0, num_gpus >= 1, peak_tflops > 0 (got {seconds}, {num_gpus}, {peak_tflops})"
        )
    tflops = flops / seconds / num_gpus / 1e12
    return tflops, tflops / peak_tflops
