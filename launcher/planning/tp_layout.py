"""megatron-core's tensor-parallel layout of a K2-family layer, per GPU, for ``k2-plan``'s step-time model
(:mod:`k2.launcher.planning.stage_model` prices what this module lays out; ``k2-train`` runs TP 1 only).

With ``parallel.tp = t`` megatron shards a layer over ``t`` consecutive ranks, with sequence parallelism
(``sequence_parallel``, which megatron's MoE layers with TP require: ``transformer_config.py``): between
the layer's parallel regions each rank holds ``T / t`` of the microbatch's ``T`` tokens, and a column-
parallel linear all-gathers its input over the TP group (``AG``), a row-parallel one reduce-scatters its
output (``RS``) (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198, section 4.2.2). Per layer (megatron-core 0.19.2 with Transformer Engine's layer spec, as
the published TP runs train; ``h`` hidden, ``H`` heads, MLA ranks ``r_q`` / ``r_kv``, rope ``d_r``):

* **attention** (``MLASelfAttention``): the down-projections are duplicated on every TP rank (TE's
  ``TELinear``, ``parallel_mode='duplicated'``) and run on the rank's ``T / t`` tokens; the q and kv
  latents (and the rope key) are all-gathered, ``T (r_q + r_kv + d_r)`` elements, for the column-parallel
  up-projections (``H / t`` heads each, all ``T`` tokens; without a q latent the q projection gathers the
  ``T h`` input itself); core attention on ``H / t`` heads; the output projection is row-parallel,
  ``RS`` of ``T h``;
* **dense MLP**: ``AG`` of ``T h`` into ``linear_fc1`` (``2 f / t`` wide), ``RS`` of ``T h`` out of
  ``linear_fc2``;
* **MoE** (expert TP 1: ``expert_tensor_parallel_size=1``, EP over the ``t x dp`` ranks, the layout of the
  published DeepSeek-V3 TP runs): the router, the permutation and the all-to-alls work on the rank's
  ``T / t`` tokens, the routed experts at full width; the shared expert is TP-sharded like a dense MLP
  (``AG`` / ``RS`` of ``T h``);
* **embedding**: vocabulary-parallel (``V / t`` rows per rank), ``RS`` of ``T h`` to the sequence-parallel
  layout; **output head**: ``AG`` of ``T h`` into a column-parallel ``[h, V / t]``, vocabulary-parallel
  cross-entropy.

The backward mirrors each collective (an ``AG`` becomes the ``RS`` of its input's gradient, an ``RS`` an
``AG``) and gathers a column-parallel linear's input again for its weight gradient (megatron's
``LinearWithGradAccumulationAndAsyncCommunication`` does not keep the gathered input): per layer the
backward moves ``2 AG + RS`` of the forward's. Nothing here overlaps TP communication with compute
(megatron's ``tp_comm_overlap`` needs TE's userbuffers): it is on the compute stream, term ``tp_comm``.
Left out: the TP all-reduce of the duplicated parameters' gradients (the down-projections', the norms';
once per step, ``h x r`` elements) and the cross-entropy's two ``T``-float all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TpCollectives", "attention_gemms", "collectives", "up_proj_gemms"]


def attention_gemms(s: dict, T: float, t: int) -> list[tuple[float, int, int]]:
    """MLA's projections on one GPU of a TP group of ``t``: ``(tokens, k, n)`` each (``s``: the layer's
    widths, :func:`k2.launcher.planning.stage_model._shapes`). ``t = 1``: the whole layer's."""
    h, H, d_qk, d_r, d_v = s["h"], s["H"], s["d_qk"], s["d_r"], s["d_v"]
    r_q, r_kv = s["r_q"], s["r_kv"]
    q = [(T / t, h, r_q), (T, r_q, H * (d_qk + d_r) // t)] if r_q else [(T, h, H * (d_qk + d_r) // t)]
    return q + [(T / t, h, r_kv + d_r), (T, r_kv, H * (d_qk + d_v) // t), (T, H * d_v // t, h)]


def up_proj_gemms(s: dict, T: float, t: int) -> list[tuple[float, int, int]]:
    """MLA's up-projections on one GPU (what ``memory.recompute`` site ``mla_up_proj`` runs again)."""
    H, d_qk, d_r, d_v = s["H"], s["d_qk"], s["d_r"], s["d_v"]
    q = [(T, s["r_q"], H * (d_qk + d_r) // t)] if s["r_q"] else []
    return q + [(T, s["r_kv"], H * (d_qk + d_v) // t)]


@dataclass(frozen=True)
class TpCollectives:
    """The TP group's all-gathers and reduce-scatters of one part of a layer in its forward, as the whole
    gathered buffer's elements each (the backward's: :attr:`backward`).

    Attributes:
        all_gather: elements of each forward all-gather.
        reduce_scatter: elements of each forward reduce-scatter.
    """

    all_gather: tuple = ()
    reduce_scatter: tuple = ()

    @property
    def forward(self) -> tuple:
        return tuple(self.all_gather) + tuple(self.reduce_scatter)

    @property
    def backward(self) -> tuple:
        """Each forward ``AG``'s input gradient reduce-scattered and the input gathered again for the weight
        gradient; each forward ``RS``'s output gradient all-gathered."""
        return tuple(self.all_gather) * 2 + tuple(self.reduce_scatter)


def collectives(s: dict, T: float, part: str) -> TpCollectives:
    """The TP collectives of ``part`` (``attention``, ``dense_mlp``, ``shared_expert``, ``embedding``,
    ``loss``) for a microbatch of ``T`` tokens (module docstring); empty for a part without them.

    Raises:
        ValueError: an unknown part.
    """
    h = s["h"]
    if part == "attention":
        gathered = (T * (s["r_q"] + s["r_kv"] + s["d_r"]),) if s["r_q"] else (T * h, T * (s["r_kv"] + s["d_r"]))
        return TpCollectives(gathered, (T * h,))
    if part in ("dense_mlp", "shared_expert"):
        return TpCollectives((T * h,), (T * h,)) if (part == "dense_mlp" or s["f_s"]) else TpCollectives()
    if part == "embedding":
        return TpCollectives((), (T * h,))
    if part == "loss":
        return TpCollectives((T * h,), ())
    raise ValueError(part)
