"""Per-layer costs of ``k2-plan``'s step-time model (:mod:`k2.launcher.planning.step_time` assembles them):
one microbatch of ``T`` tokens through one layer on one GPU, per pass (``F`` forward, ``B`` input gradient,
``W`` weight gradient) and term (``gemm``, ``attention``, ``non_gemm``, ``quantize``, ``ep_comm``,
``ep_token_counts``, ``recompute``, ``tp_comm``), seconds.

A layer is also split into megatron-core's schedule nodes (``models/gpt/fine_grained_callables.py``
``build_transformer_layer_callables``, 0.19.2), which the EP-overlap model
(:mod:`k2.launcher.planning.ep_overlap`) runs on two streams: ``attn`` (``pre_dispatch_computation``:
attention, the pre-MLP norm, the shared expert, the router, the all-gather of the token counts per
expert and the token permutation), ``dispatch``
(``moe_dispatch``: the all-to-all), ``mlp`` (the routed experts, or a dense layer's MLP) and ``combine``
(``moe_combine``: the all-to-all, the un-permutation, the shared expert's add and the residual). The
nodes' terms add up to :meth:`StageModel.layer`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k2.launcher.planning.comm import crosses_nodes, ep_alltoall, ring_seconds
from k2.launcher.planning.hardware import HardwareProfile
from k2.launcher.planning.kernels import (
    WGRAD_OUT_BYTES,
    KernelRates,
    attention_seconds,
    elementwise_seconds,
    gemm_seconds,
    grouped_gemm_seconds,
)
from k2.launcher.planning.operator_counts import ATTENTION_KERNELS, MOE_NODE_OPERATORS, OPERATORS
from k2.launcher.planning.placement import ep_group_pieces
from k2.launcher.planning.tp_layout import attention_gemms, collectives, up_proj_gemms
from k2.launcher.planning.what_if import WhatIf

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig

#: element-wise backward bytes per forward byte: it reads the saved input and the output gradient and
#: writes the input gradient
BACKWARD_BYTES_FACTOR = 1.5
#: megatron's schedule nodes of a transformer layer (module docstring), in forward order
NODES = ("attn", "dispatch", "mlp", "combine")
#: bytes moved per element to quantise a BF16 GEMM operand for an FP8 GEMM (``train.fp8_recipe``): the BF16
#: tensor read (2), its FP8 copies along rows and along columns written (the weight gradient's GEMM takes
#: the transpose; Transformer Engine makes both at once), each with one scale byte per 32 elements (MXFP8's
#: E8M0 per 1 x 32; blockwise: an FP32 scale per 1 x 128, the same 1/32 byte)
FP8_QUANTIZE_BYTES = 2 + 2 * (1 + 1 / 32)


def _shapes(model_cfg: ModelConfig) -> dict:
    """The layer's widths (MLA's projections per GPU: :func:`k2.launcher.planning.tp_layout.attention_gemms`)."""
    m = model_cfg
    h, H = int(m.hidden_size), int(m.num_attention_heads)
    d_qk, d_r, d_v = int(m.qk_head_dim), int(m.qk_pos_emb_head_dim), int(m.v_head_dim)
    r_q, r_kv = m.q_lora_rank, int(m.kv_lora_rank)
    E = int(m.num_moe_experts or 0)
    return {
        "h": h,
        "H": H,
        "d_qk": d_qk,
        "d_r": d_r,
        "d_v": d_v,
        "r_q": int(r_q or 0),
        "r_kv": r_kv,
        "E": E,
        "k": int(m.moe_router_topk or 0) if E else 0,
        "f": int(m.ffn_hidden_size),
        "f_e": int(m.moe_ffn_hidden_size or 0),
        "f_s": int(m.moe_shared_expert_intermediate_size or 0),
        "V": int(m.vocab_size),
        "groups": int(m.moe_router_num_groups or 0),
        "group_topk": int(m.moe_router_group_topk or 0),
    }


def moe_nongemm_elements(s: dict) -> dict[str, tuple[float, float]]:
    """Per schedule node of a MoE layer, the elements its element-wise kernels read and write per token
    in the forward: ``(at the activation width, in FP32)`` (:func:`nongemm_bytes_per_token`'s ``moe``
    terms): ``attn`` the pre-MLP RMSNorm 2h, the router's scores and top-k 4E (FP32), the permutation
    2kh, the shared expert's SwiGLU 3 f_s; ``mlp`` the routed experts' SwiGLU 3 k f_e; ``combine`` the
    un-permutation and weighted sum (k + 1) h, the shared expert's add 3h, the residual 3h."""
    h, k = s["h"], s["k"]
    return {
        "attn": (2 * h + 2 * k * h + 3 * s["f_s"], 4 * s["E"]),
        "dispatch": (0.0, 0.0),
        "mlp": (3 * k * s["f_e"], 0.0),
        "combine": ((k + 1) * h + 3 * h + 3 * h, 0.0),
    }


def nongemm_bytes_per_token(s: dict, kind: str, act_bytes: float, tp: int = 1) -> float:
    """Bytes the element-wise kernels of one layer's forward read and write per token of the microbatch, on
    one GPU of a TP group of ``tp`` (:mod:`k2.launcher.planning.tp_layout`: the norms, residuals, router,
    permutation and SwiGLUs on ``1 / tp`` of the tokens or the width, RoPE and the q / k assembly on
    ``H / tp`` heads of every token).

    ``kind``: ``attention`` (input RMSNorm 2h, q / kv latent RMSNorms 2 r_q + 2 r_kv, RoPE on q and the
    shared key 2 (H + 1) d_r, assembling q and k from their nope / rope parts 4 H (d_qk + d_r), the residual
    add 3h), ``dense_mlp`` (RMSNorm 2h, SwiGLU 3f, residual 3h), ``moe`` (RMSNorm 2h, router scores and
    top-k 4E in FP32, permutation 2kh, SwiGLU of the k routed and the shared expert 3 (k f_e + f_s),
    unpermutation and weighted sum (k + 1) h, adding the shared expert 3h, residual 3h:
    :func:`moe_nongemm_elements`), ``loss`` (final RMSNorm 2h, softmax cross-entropy over the FP32
    logits: 3V); times ``act_bytes`` per element (FP32 terms at 4).
    """
    h, H, t = s["h"], s["H"], tp
    if kind == "attention":
        heads = H / t
        n = (
            (2 * h + 2 * s["r_q"] + 2 * s["r_kv"] + 3 * h) / t
            + 2 * (heads + 1) * s["d_r"]
            + 4 * heads * (s["d_qk"] + s["d_r"])
        )
        return n * act_bytes
    if kind == "dense_mlp":
        return (2 * h + 3 * s["f"] + 3 * h) * act_bytes / t
    if kind == "moe":
        return sum(a * act_bytes + f * 4 for a, f in moe_nongemm_elements(s).values()) / t
    if kind == "loss":
        return (2 * h * act_bytes + 3 * s["V"] * 4) / t
    raise ValueError(kind)


def _add(d: dict, key: str, v: float) -> None:
    d[key] = d.get(key, 0.0) + v


def _passes() -> dict:
    return {"F": {}, "B": {}, "W": {}}


class StageModel:
    """Per-layer costs of one phase on one layout: :func:`k2.launcher.planning.step_time.step_time` drives
    it, and :mod:`k2.launcher.planning.trace_rates` prices a published trace's chunk with it (seconds)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        fl,
        dims,
        *,
        tokens: int,
        profile: HardwareProfile,
        rates: KernelRates,
        act_bytes: float,
        grouped: bool,
        what_if: WhatIf,
        recompute,
        fp8_recipe: str | None = None,
        high_rates: KernelRates | None = None,
    ):
        """``rates``: the layers' GEMMs' (FP8 with ``fp8_recipe``: :meth:`quantize_s` prices their
        operands' quantisation); ``high_rates``: the router's and the output head's, which stay in the
        training precision (default ``rates``)."""
        self.s, self.fl, self.dims, self.T = _shapes(model_cfg), fl, dims, tokens
        self.profile, self.rates, self.a = profile, rates, act_bytes
        self.high_rates = high_rates or rates
        self.grouped, self.wi, self.recompute = grouped, what_if, set(recompute or ())
        self.fp8_recipe = fp8_recipe
        self.tp = int(getattr(dims, "tp", 1) or 1)  # (a published trace's chunk: no layout, TP 1)

    # ---- one layer: {"F": {...}, "B": {...}, "W": {...}} seconds per term
    def _gemms(
        self,
        shapes,
        out: dict,
        m: float | None = None,
        groups: int = 1,
        tag: str = "gemm",
        rates: KernelRates | None = None,
    ) -> dict:
        """The GEMMs ``[m, k] x [k, n]`` of ``shapes`` (``groups`` of each: the local experts) forward, input
        and weight gradient into ``out`` under ``tag``; at ``rates`` (default the layers': FP8 with a recipe,
        their operands' quantisation under ``quantize``)."""
        T = self.T if m is None else m
        r = rates or self.rates
        kernels = 1 if groups > 1 and self.grouped else groups
        for k, n in shapes:
            if groups > 1 and self.grouped:
                f, b, w = (
                    grouped_gemm_seconds(groups, T, k, n, r),
                    grouped_gemm_seconds(groups, T, n, k, r),
                    grouped_gemm_seconds(groups, k, T, n, r, WGRAD_OUT_BYTES),
                )
            else:
                f = groups * gemm_seconds(T, k, n, r)
                b = groups * gemm_seconds(T, n, k, r)
                w = groups * gemm_seconds(k, T, n, r, WGRAD_OUT_BYTES)
            _add(out["F"], tag, f)
            _add(out["B"], tag, b)
            _add(out["W"], tag, w)
            if self.fp8_recipe and rates is None:
                _add(out["F"], "quantize", self.quantize_s(groups * T * k, kernels))
                _add(out["B"], "quantize", self.quantize_s(groups * T * n, kernels))
        return out

    def quantize_s(self, elements: float, kernels: int = 1) -> float:
        """Seconds to quantise ``elements`` of one FP8 GEMM operand (``train.fp8_recipe``) in ``kernels``
        launches: :data:`FP8_QUANTIZE_BYTES` per element at the memory rate. Per GEMM the forward quantises
        its input, the backward its output gradient (the weight gradient takes their column-wise copies);
        the weights are quantised once per step (Transformer Engine keeps them over a step's microbatches),
        not counted."""
        return elementwise_seconds(FP8_QUANTIZE_BYTES * elements, kernels, self.rates)

    def _nongemm(self, kind: str, out: dict, experts: int = 0, rates: KernelRates | None = None) -> None:
        """The element-wise operators of ``kind``: their bytes at the memory rate plus one launch each
        (:data:`OPERATORS`; ``experts``: megatron's sequential experts, each with its own operators)."""
        nbytes = nongemm_bytes_per_token(self.s, kind, self.a, self.tp) * self.T
        per_expert = OPERATORS["moe_per_expert"]
        f_ops, b_ops = (n + experts * e for n, e in zip(OPERATORS[kind], per_expert))
        r = rates or self.rates
        _add(out["F"], "non_gemm", elementwise_seconds(nbytes, f_ops, r))
        _add(out["B"], "non_gemm", elementwise_seconds(BACKWARD_BYTES_FACTOR * nbytes, b_ops, r))

    def _moe_nongemm(self, nodes: dict, experts: int) -> None:
        """A MoE layer's element-wise operators (:meth:`_nongemm` ``moe``) split over its schedule nodes:
        bytes by :func:`moe_nongemm_elements`, the operators by :data:`MOE_NODE_OPERATORS`' counted shares,
        the sequential experts' own operators in ``mlp``; the parts add up to the whole."""
        nbytes = nongemm_bytes_per_token(self.s, "moe", self.a, self.tp) * self.T
        parts = {n: a * self.a + f * 4 for n, (a, f) in moe_nongemm_elements(self.s).items()}
        whole = sum(parts.values()) or 1.0
        counted = [sum(x[i] for x in MOE_NODE_OPERATORS.values()) for i in (0, 1)]
        for name, ops in MOE_NODE_OPERATORS.items():
            share = nbytes * parts[name] / whole
            f_ops, b_ops = (OPERATORS["moe"][i] * ops[i] / counted[i] for i in (0, 1))
            if name == "mlp":
                f_ops, b_ops = (
                    f_ops + experts * OPERATORS["moe_per_expert"][0],
                    b_ops + experts * OPERATORS["moe_per_expert"][1],
                )
            _add(nodes[name]["F"], "non_gemm", elementwise_seconds(share, f_ops, self.rates))
            _add(nodes[name]["B"], "non_gemm", elementwise_seconds(BACKWARD_BYTES_FACTOR * share, b_ops, self.rates))

    def attention_gemms(self, out: dict, tag: str = "gemm") -> None:
        """MLA's projections (down, up, output) on this GPU of its TP group
        (:func:`k2.launcher.planning.tp_layout.attention_gemms`): their GEMMs added to ``out`` under ``tag``."""
        for m, k, n in attention_gemms(self.s, self.T, self.tp):
            self._gemms([(k, n)], out, m=m, tag=tag)

    def expert_gemms(
        self, out: dict, ep: int, expert_tag: str = "gemm", shared_tag: str = "gemm", shared_out: dict | None = None
    ) -> tuple:
        """A MoE layer's routed experts (``E / ep`` local ones at full width, expert TP 1, as one grouped GEMM
        of ``(T / tp) k ep / E`` tokens each: the rank's tokens, balanced routing) into ``out`` and its
        TP-sharded shared expert into ``shared_out`` (default ``out``); returns (local experts, their
        tokens)."""
        s, t = self.s, self.tp
        local, m = max(1, s["E"] // ep), self.T / t * s["k"] * ep / s["E"]
        self._gemms([(s["h"], 2 * s["f_e"]), (s["f_e"], s["h"])], out, m=m, groups=local, tag=expert_tag)
        if s["f_s"]:
            self._gemms(
                [(s["h"], 2 * s["f_s"] // t), (s["f_s"] // t, s["h"])],
                out if shared_out is None else shared_out,
                tag=shared_tag,
            )
        return local, m

    def up_proj_recompute_s(self) -> float:
        """Seconds of MLA's up-projections run again in the backward (``memory.recompute`` ``mla_up_proj``)."""
        return sum(gemm_seconds(m, k, n, self.rates) for m, k, n in up_proj_gemms(self.s, self.T, self.tp))

    def tp_comm(self, out: dict, part: str, T: float | None = None) -> None:
        """The TP collectives of ``part`` (:func:`k2.launcher.planning.tp_layout.collectives`) into ``out``'s
        forward and backward as term ``tp_comm``: rings over the TP group's consecutive ranks
        (:func:`k2.launcher.planning.comm.ring_seconds`, across NVLink domains only when the group is
        larger than one). Nothing without TP."""
        if self.tp <= 1:
            return
        c = collectives(self.s, self.T if T is None else T, part)
        cross = crosses_nodes(self.tp, self.profile)
        for ph, elements in (("F", c.forward), ("B", c.backward)):
            seconds = sum(ring_seconds(e * self.a, self.tp, cross, self.profile) for e in elements)
            if seconds:
                _add(out[ph], "tp_comm", seconds)

    def layer_nodes(self, i: int) -> dict[str, dict]:
        """Layer ``i`` per schedule node (module docstring) on this GPU of its TP group
        (:mod:`k2.launcher.planning.tp_layout`): ``{node: {"F": {...}, "B": {...}, "W": {...}}}`` seconds per
        term, the non-GEMM floor (:meth:`_nongemm_floor`) shared over the compute nodes in proportion to their
        GEMM and attention time; whole-layer recompute is :meth:`layer`'s. A dense layer has ``attn`` and
        ``mlp`` only (megatron's dispatch and combine are no-ops there). The recompute sites
        (``memory.recompute``) add their forward again to the backward: ``mla_up_proj``, ``layernorm``,
        ``core_attn`` (core attention), ``mlp`` (a dense layer's MLP), ``moe`` (a MoE layer's router,
        all-to-alls, experts and shared expert), ``swiglu``, ``moe_down_proj``."""
        s, T, r, t = self.s, self.T, self.rates, self.tp
        moe = bool(self.fl.moe_pattern[i])
        nodes = {n: _passes() for n in (NODES if moe else ("attn", "mlp"))}
        attn, mlp = nodes["attn"], nodes["mlp"]
        self.attention_gemms(attn)
        self.tp_comm(attn, "attention")
        core = self.fl.attention_core * T / t  # (H / t heads)
        _add(attn["F"], "attention", attention_seconds(core, r, ATTENTION_KERNELS[0]))
        _add(attn["B"], "attention", attention_seconds(2 * core, r, ATTENTION_KERNELS[1]))
        self._nongemm("attention", attn)
        rec_attn = rec_mlp = 0.0
        if "mla_up_proj" in self.recompute:
            rec_attn += self.up_proj_recompute_s()
        if "layernorm" in self.recompute:
            rec_attn += elementwise_seconds(2 * (s["h"] + s["r_q"] + s["r_kv"]) * self.a * T / t, 3, r)
        if "core_attn" in self.recompute:
            rec_attn += attention_seconds(core, r, ATTENTION_KERNELS[0])
        if moe:
            rec_mlp += self._moe_parts(nodes)
        else:
            self._gemms([(s["h"], 2 * s["f"] // t), (s["f"] // t, s["h"])], mlp)
            self.tp_comm(mlp, "dense_mlp")
            self._nongemm("dense_mlp", mlp)
            if "mlp" in self.recompute:
                rec_mlp += sum(mlp["F"].values())
            elif "swiglu" in self.recompute:
                rec_mlp += elementwise_seconds(3 * s["f"] / t * self.a * T, 1, r)
        _add(attn["B"], "recompute", rec_attn)
        _add(mlp["B"], "recompute", rec_mlp)
        self._share_nongemm_floor(nodes)
        return nodes

    def _moe_parts(self, nodes: dict) -> float:
        """A MoE layer's router, shared expert (in ``attn``, with the token-count all-gather), all-to-alls,
        routed experts and element-wise operators into ``nodes``; returns what its recompute sites add to
        the backward (``moe``: the whole MoE forward; else ``moe_down_proj``, ``swiglu``)."""
        s, T, r, t = self.s, self.T, self.rates, self.tp
        attn, mlp = nodes["attn"], nodes["mlp"]
        before = sum(attn["F"].values())
        self._gemms([(s["h"], s["E"])], attn, m=T / t, rates=self.high_rates)  # the router (not a TE linear)
        local, m = self.expert_gemms(mlp, self.dims.ep, shared_out=attn)
        self.tp_comm(attn, "shared_expert")
        self._moe_nongemm(nodes, 0 if self.grouped else local)
        if self.dims.ep > 1:
            _add(attn["F"], "ep_token_counts", self.token_counts_s())
        for name, seconds in zip(("dispatch", "combine"), self._ep_alltoalls()):
            _add(nodes[name]["F"], "ep_comm", seconds)
            _add(nodes[name]["B"], "ep_comm", seconds)
        if "moe" in self.recompute:  # (megatron's moe recompute: the MoE layer's forward, all-to-alls too)
            return sum(attn["F"].values()) - before + sum(sum(nodes[n]["F"].values()) for n in NODES[1:])
        rec = 0.0
        if "moe_down_proj" in self.recompute:
            rec += (
                grouped_gemm_seconds(local, m, s["f_e"], s["h"], r)
                if self.grouped
                else local * gemm_seconds(m, s["f_e"], s["h"], r)
            )
        if "swiglu" in self.recompute:
            rec += elementwise_seconds(3 * (s["k"] * s["f_e"] + s["f_s"]) / t * self.a * T, 2, r)
        return rec

    def layer(self, i: int) -> dict:
        """Layer ``i``: ``{"F": {...}, "B": {...}, "W": {...}}`` seconds per term (its nodes added up; with
        ``memory.recompute`` site ``layer`` the recompute is the whole forward again, its all-to-alls too)."""
        out = _passes()
        for node in self.layer_nodes(i).values():
            for ph in out:
                for k, v in node[ph].items():
                    _add(out[ph], k, v)
        if "layer" in self.recompute:
            out["B"]["recompute"] = sum(out["F"].values())  # the whole forward again (its all-to-alls too)
        return out

    @staticmethod
    def _compute_s(part: dict, ph: str) -> float:
        """GEMM + attention seconds of ``part``'s pass ``ph`` (``B`` with its weight gradient)."""
        x = part[ph].get("gemm", 0.0) + part[ph].get("attention", 0.0)
        return x + (part["W"].get("gemm", 0.0) if ph == "B" else 0.0)

    def _nongemm_floor(self, out: dict) -> None:
        """The profile's ``nongemm_share``: non-GEMM time at least that share of the pass's compute stream
        (GEMMs + attention + non-GEMM, the FP8 quantisation among the non-GEMM kernels), per pass."""
        share = self.profile.nongemm_share
        if share <= 0:
            return
        for ph in ("F", "B"):
            q = out[ph].get("quantize", 0.0)
            floor = share / (1 - share) * self._compute_s(out, ph) - q
            out[ph]["non_gemm"] = max(out[ph].get("non_gemm", 0.0), floor)

    def _share_nongemm_floor(self, nodes: dict) -> None:
        """:meth:`_nongemm_floor` on the layer's nodes together: what the floor adds to the layer's
        non-GEMM time goes to its nodes in proportion to their GEMM + attention time."""
        share = self.profile.nongemm_share
        if share <= 0:
            return
        for ph in ("F", "B"):
            compute = {n: self._compute_s(p, ph) for n, p in nodes.items()}
            have = sum(p[ph].get("non_gemm", 0.0) + p[ph].get("quantize", 0.0) for p in nodes.values())
            extra = share / (1 - share) * sum(compute.values()) - have
            if extra <= 0:
                continue
            for n, p in nodes.items():
                _add(p[ph], "non_gemm", extra * compute[n] / sum(compute.values()))

    def _node_limit(self) -> int | None:
        """Nodes a token may visit: ``plan.what_if.node_limit``, else the model's group-limited routing
        (``moe_router_num_groups`` groups, ``moe_router_group_topk`` chosen) when the EP group's nodes hold
        one group each (DeepSeek-V3's node-limited routing, arXiv 2412.19437 section 2.1.2)."""
        if self.wi.node_limit:
            return int(self.wi.node_limit)
        groups, topk = self.s["groups"], self.s["group_topk"]
        per_node = max(1, min(self.dims.ep, self.profile.domain_gpus))
        nodes = -(-self.dims.ep // per_node)
        return topk if groups and topk and nodes == groups else None

    def _ep_alltoalls(self) -> tuple[float, float]:
        """Seconds of one MoE layer's dispatch and of its combine all-to-all in one pass
        (:func:`k2.launcher.planning.comm.ep_alltoall`; DeepEP's FP8 dispatch under the what-if), each with
        the wait for the group's last rank to issue it (the profile's ``alltoall_peer_wait_us``)."""
        s, d, wi = self.s, self.dims, self.wi
        dispatch_bytes = (1 + 4 / 128) if (wi.deepep and self.fp8_recipe) else self.a  # FP8 + a scale per 128
        a2a = [
            ep_alltoall(
                self.T / self.tp,
                s["k"],
                s["h"],
                d.ep,
                self.profile,
                bytes_per_element=b,
                deepep=wi.deepep,
                node_limit=self._node_limit(),
                pieces=self._ep_pieces(),
            )
            for b in (dispatch_bytes, self.a)
        ]
        wait = self.profile.alltoall_peer_wait_us * 1e-6 if d.ep > 1 else 0.0
        return a2a[0].seconds + wait, a2a[1].seconds + wait

    def _token_counts_group(self) -> tuple[int, bool]:
        """The ranks of the token-count all-gather (megatron's ``tp_ep`` group: expert TP x EP, so the EP
        group with expert TP 1) and whether it crosses NVLink domains."""
        return self.dims.ep, any(len(p) > 1 for p in self._ep_pieces())

    def _ep_pieces(self) -> tuple[tuple[int, ...], ...]:
        """How the layout's EP groups fall across NVLink domains (:mod:`k2.launcher.planning.placement`)."""
        d = self.dims
        return ep_group_pieces(d.world_size, d.pp, d.ep, self.profile.domain_gpus)

    def token_counts_s(self) -> float:
        """Seconds of the all-gather of the token counts per expert in one MoE layer's forward
        (megatron-core 0.19.2 ``MoEAlltoAllTokenDispatcher.preprocess``: each of the ``ep`` ranks gives
        its ``E`` int64 counts, so that the dispatch's split sizes are known; without token dropping it
        is a collective on the compute stream before every dispatch): a ring of that group
        (:func:`k2.launcher.planning.comm.ring_seconds`), latency-bound."""
        group, cross = self._token_counts_group()
        return ring_seconds(group * self.s["E"] * 8, group, cross, self.profile)

    def token_counts_queue_s(self) -> float:
        """Seconds :meth:`token_counts_s` waits longer where an all-to-all is on the wire meanwhile: each
        ring step's message queues behind the all-to-all's bytes in front of the link (the profile's
        ``network_loaded_latency_us`` over ``network_latency_us``; 0 inside a node)."""
        group, cross = self._token_counts_group()
        p = self.profile
        loaded = p.network_loaded_latency_us if p.network_loaded_latency_us is not None else p.network_latency_us
        return (group - 1) * max(0.0, loaded - p.network_latency_us) * 1e-6 if cross else 0.0

    def embedding(self) -> dict:
        """The word embedding (vocabulary-parallel over TP, :mod:`k2.launcher.planning.tp_layout`): a gather of
        ``T`` rows forward; backward its dense ``[V / tp, h]`` FP32 gradient written and added (megatron's
        embedding backward, then the gradient buffer)."""
        out = _passes()
        h, V = self.s["h"], self.s["V"]
        f_ops, b_ops = OPERATORS["embedding"]
        r = self.profile.part_rates(self.rates, "embedding")
        _add(out["F"], "non_gemm", elementwise_seconds(2 * self.T * h * self.a, f_ops, r))
        _add(out["B"], "non_gemm", elementwise_seconds(self.T * h * self.a + 3 * V / self.tp * h * 4, b_ops, r))
        self.tp_comm(out, "embedding")
        return out

    def loss(self) -> dict:
        """The final norm, the output layer (``[h, V / tp]`` per GPU) and the vocabulary-parallel loss (their
        operators at the profile's ``loss`` cost)."""
        out = _passes()
        r = self.profile.part_rates(self.high_rates, "loss")  # (the output head: not a TE linear)
        self._gemms([(self.s["h"], self.s["V"] // self.tp)], out, rates=r)
        self._nongemm("loss", out, rates=r)
        self.tp_comm(out, "loss")
        self._nongemm_floor(out)
        return out

    def mtp(self) -> dict:
        """One multi-token-prediction module on the stage holding the loss (``plan.what_if.mtp_layers``;
        DeepSeek-V3, arXiv 2412.19437 section 2.2): the next token's embedding gathered (2h), the RMSNorms
        of it and of the hidden state (2 x 2h) and their concatenation (4h) in 4 operators, the projection
        ``[T, 2h] x [2h, h]``, one MoE transformer block as the model's (its all-to-alls and recompute sites
        included) and the shared output head and loss again (:meth:`loss`)."""
        out = _passes()
        h = self.s["h"]
        moe = [i for i, x in enumerate(self.fl.moe_pattern) if x]
        nbytes = (2 + 4 + 4) * h * self.a * self.T
        _add(out["F"], "non_gemm", elementwise_seconds(nbytes, 4, self.rates))
        _add(out["B"], "non_gemm", elementwise_seconds(BACKWARD_BYTES_FACTOR * nbytes, 4, self.rates))
        self._gemms([(2 * h, h)], out)
        for part in (self.layer(moe[-1] if moe else 0), self.loss()):
            for ph in out:
                for k, v in part[ph].items():
                    _add(out[ph], k, v)
        return out
