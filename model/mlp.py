"""K2's MLP forward (dense layers, shared expert, routed experts) with its activation-memory switches.

megatron-core's ``MLP.forward`` computes ``fc2(act(fc1(x)) * p)`` (``p`` = the router probability of a
routed expert, ``per_token_scale``) in one block, with no way to recompute the SwiGLU activation outside
grouped-GEMM experts (megatron's ``moe_act`` recompute needs ``moe_grouped_gemm``, i.e. Transformer Engine)
or to recompute the MoE down-projection (megatron has no such option), and no place to mark the tensors
it saves. :func:`mlp_forward` is that forward, written out, for any megatron ``MLP`` module; the modules
keep megatron's ``MLP`` parameters and state-dict layout:

* :class:`K2MLP` -- dense layers (megatron ``MLP``);
* :class:`K2SharedExpertMLP` -- the shared expert (megatron ``SharedExpertMLP``: gate, overlap);
* :class:`K2SequentialMLP` -- the routed experts (megatron ``SequentialMLP``, one ``MLP`` per expert).

Switches (``model/activation_memory.py`` :class:`~k2.model.activation_memory.MemoryOptions`,
          docs/k2_reference.md "Training system"):

* ``recompute=swiglu``: SwiGLU (with the probability scale where megatron applies it) keeps only its
  input, and its output, which ``linear_fc2`` saves for the weight gradient, is recomputed from that
  input when fc2's backward needs it (:func:`k2.model.recompute.recompute_output`).
* ``recompute=moe_down_proj``: routed experts compute ``p * fc2(act(fc1(x)))`` -- the K2 / DeepSeek-V3
  placement of the gate, ``h' = sum_i g_i FFN_i(x)``, equal to megatron's ``fc2(p * act)`` because fc2 is
  linear without bias -- and the down-projection output ``[t, h]``, which the multiply by ``p`` saves
  for the gradient of ``p``, is not kept but recomputed from fc2's input in backward. (With megatron's
  placement the down-projection output is never saved, so there is nothing to recompute; K2 recomputes
  it because its gate follows fc2.)
* sites marked for FP8 storage / offload (``model/saved_tensors.py``): ``moe_fc1_input`` (routed experts'
  fc1 input), ``swiglu_input`` (fc1 output), ``fc2_input`` (SwiGLU output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from k2.model.recompute import recompute_output
from k2.model.saved_tensors import mark, mark_recompute


def swiglu(u: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(u1) * u2`` for ``u = [u1, u2]`` ``[..., 2f]`` (megatron's ``gated_linear_unit`` layout),
    times ``probs`` ``[...]`` when given, in ``u``'s dtype. Returns ``[..., f]``."""
    u1, u2 = torch.chunk(u, 2, dim=-1)
    a = F.silu(u1) * u2
    if probs is not None:
        a = (a * probs.unsqueeze(-1)).to(u.dtype)
    return a


def mlp_forward(
    mlp: MLP, hidden_states: torch.Tensor, probs: torch.Tensor | None, memory, routed: bool
) -> torch.Tensor:
    """``fc2(swiglu(fc1(x)))`` of a megatron ``MLP`` with the memory switches of ``memory``.

    Args:
        mlp: a megatron ``MLP`` (its ``linear_fc1``/``linear_fc2``, no biases).
        hidden_states: ``[..., h]``; for a routed expert ``[t, h]``, its ``t`` tokens.
        probs: ``[t]`` router probabilities of a routed expert (None otherwise).
        memory: :class:`k2.model.activation_memory.MemoryOptions` or None (all off).
        routed: True for a routed expert.

    Returns:
        ``[..., h]``, the probability-weighted output for a routed expert.

    Raises:
        ValueError: a bias on fc1/fc2 (K2 has none; megatron's bias handling is not reproduced here).
    """
    policy = memory.policy if memory is not None else (lambda site: None)
    recompute = memory.recomputes if memory is not None else (lambda site: False)
    grad = torch.is_grad_enabled()
    if routed:
        mark(hidden_states, policy("moe_fc1_input"))
    u, bias = mlp.linear_fc1(hidden_states)
    if bias is not None:
        raise ValueError("K2 MLPs have no biases (model.add_bias_linear is off)")
    mark(u, policy("swiglu_input"))
    gate_after_fc2 = routed and probs is not None and recompute("moe_down_proj")
    act_probs = None if gate_after_fc2 else probs
    if grad and recompute("swiglu"):
        # fc2 saves a for its weight gradient: recomputed from u instead of kept
        a = recompute_output(swiglu, u, act_probs, site="swiglu")
        node = a.grad_fn
        a_source = lambda: swiglu(*node.saved_tensors)  # noqa: E731
    else:
        a = swiglu(u, act_probs)
        mark(a, policy("fc2_input"))
        a_source = lambda: a  # noqa: E731 (a is kept by fc2 anyway)
    y, bias = mlp.linear_fc2(a)
    if bias is not None:
        raise ValueError("K2 MLPs have no biases (model.add_bias_linear is off)")
    if not gate_after_fc2:
        return y
    if grad:
        # the gate multiply saves y = fc2(a) [t, h] for the gradient of p: recomputed from fc2's input
        mark_recompute(y, lambda: mlp.linear_fc2(a_source())[0], "moe_down_proj")
    return (y * probs.unsqueeze(-1)).to(y.dtype)


class K2MLP(MLP):
    """megatron ``MLP`` whose forward is :func:`mlp_forward` (dense layers).

    ``memory`` (:class:`k2.model.activation_memory.MemoryOptions`, read per forward) is set by
    ``k2.model.activation_memory.set_memory_options``; None = all off.
    """

    memory = None

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        """``[s, b, h] -> ([s, b, h], None)`` (megatron's ``(output, bias)``)."""
        return mlp_forward(self, hidden_states, per_token_scale, self.memory, routed=False), None


class K2SharedExpertMLP(SharedExpertMLP, K2MLP):
    """megatron ``SharedExpertMLP`` (gate, overlap) on :func:`mlp_forward` (its ``super().forward``)."""


def build_k2_shared_experts(*, config, pg_collection, gate: bool, submodules, name: str | None = None):
    """Spec builder of the shared expert (megatron's ``moe_module_specs._build_shared_experts`` minus the
    TE-only fused variant)."""
    if getattr(config, "use_grouped_gemm_for_shared_expert", False):
        raise ValueError("use_grouped_gemm_for_shared_expert needs Transformer Engine; the K2 build has none")
    return K2SharedExpertMLP(config=config, submodules=submodules, gate=gate, pg_collection=pg_collection, name=name)


class K2SequentialMLP(SequentialMLP):
    """megatron ``SequentialMLP`` (one ``MLP`` per local expert) whose experts run :func:`mlp_forward`.

    Same split of the permuted tokens by ``tokens_per_expert`` and the same concatenation as megatron's
    forward; megatron's FP8/FP4 GEMM padding does not apply (no FP8 GEMMs).
    """

    memory = None

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ):
        """``[T, h]`` tokens grouped by local expert, ``[num_local_experts]`` counts, ``[T]`` probabilities
        -> ``([T, h], None)``."""
        if self.config.fp8 or self.config.fp4 or self.config.moe_apply_probs_on_input:
            raise ValueError("K2SequentialMLP: fp8/fp4 GEMMs and moe_apply_probs_on_input are not supported")
        if self.num_local_experts == 1:
            expert = self.local_experts[0]
            return mlp_forward(expert, permuted_local_hidden_states, permuted_probs, self.memory, True), None
        counts = tokens_per_expert.tolist()
        tokens = torch.split(permuted_local_hidden_states, counts)
        probs = torch.split(permuted_probs, counts)
        outs = [mlp_forward(e, t, p, self.memory, True) for e, t, p in zip(self.local_experts, tokens, probs)]
        return torch.cat(outs, dim=0), None
