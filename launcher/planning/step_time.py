"""``k2-plan``'s step time from a performance model: kernels, communication, recompute, offload, the
optimizer and the pipeline bubble, per term, on a hardware profile (:mod:`k2.launcher.planning.hardware`).

Per virtual stage and microbatch of ``T = micro_batch_size x seq_length`` tokens (one GPU, TP = 1):

* **GEMMs** at their shapes (:mod:`k2.model.kernels`: roofline, tile and wave quantization, a launch cost
  each): MLA's projections ``[T, h] x [h, r_q]`` ..., the dense / shared SwiGLU, the router, the routed
  experts as one grouped GEMM of ``E / ep`` experts of ``T k ep / E`` tokens each (balanced routing;
  megatron's sequential loop of ``E / ep`` GEMMs where ``model.moe_grouped_gemm`` is off, the CPU default),
  the LM head. Backward: the input gradient ``[T, n] x [n, k]`` (B) and the weight gradient ``[k, T] x [T,
  n]`` (W) of each.
* **Core attention** at the profile's attention rate, backward twice the forward's FLOPs.
* **Non-GEMM kernels** (norms, RoPE, q/k assembly, SwiGLU, router scores and top-k, token permutation,
  residual adds, the loss): the bytes each reads and writes (:func:`nongemm_bytes_per_token`) at the
  profile's achieved memory bandwidth, plus a launch cost per operator (:data:`OPERATORS`, counted on
  k2-train's modules, forward and backward apart); the backward of an element-wise kernel reads its
  saved input and the output gradient and writes the input gradient: 1.5 x the forward's bytes. The
  first stage adds the word embedding (its gather, its dense gradient). Real kernels are slower than
  this roofline (unfused FP32 upcasts, several passes): a GPU profile's ``nongemm_share`` (0.27:
  DeepSeek-V3's published training profile) sets the least share of a pass's compute stream they take.
* **EP all-to-all**: dispatch and combine per MoE layer in the forward and again in the backward
  (:func:`k2.launcher.planning.comm.ep_alltoall`). Overlap rule: the trainer's schedule (megatron's
  (interleaved) 1F1B with the ``alltoall`` dispatcher) runs them on the compute stream between the
  expert GEMMs, so they are **exposed**; only the DualPipe what-if hides them behind the paired
  microbatch's compute (DeepSeek-V3, arXiv 2412.19437 section 3.2.1), with 20 of 132 SMs given to
  communication (section 3.2.2) so compute runs at 112/132 of its rates.
* **Recompute** (``memory.recompute``): the sites' forward work again in the backward (``layer``: the whole
  forward, its all-to-alls included).
* **Activation offload** (``memory.offload``): the stage's offloaded bytes go out during the forward and
  back during the backward on a copy stream (its own engine and PCIe path); only what exceeds the pass's
  time (compute and all-to-alls) is exposed.
* **The schedule's own work** (``schedule``): a measured CPU profile's cost of megatron's schedule and the
  trainer's step functions beyond the model's operators, per microbatch and virtual stage and per step.
* **PP sends**: ``T x h`` activations per stage boundary, across nodes when PP ranks are on different nodes,
  as the simulator's ``p2p_time``.

The pipeline: megatron's (interleaved) 1F1B order simulated with these per-stage times
(:func:`k2.schedules.pipeline_sim.simulate`); the **bubble** is the busiest PP rank's idle time in it
(with the DualPipe what-if, PP rank r runs stage r and stage PP - 1 - r, half the microbatches each, and
DualPipe's bubble ``(PP/2 - 1)(F&B + B - 3W)``, arXiv 2412.19437 table 2).
After the pipeline: the **DP gradient reduce-scatter** (FP32, megatron's ZeRO-1 buffers) and **parameter
all-gather** (BF16), exposed (``overlap_grad_reduce`` / ``overlap_param_gather`` are off in ``k2-train``;
the ``fsdp`` what-if: per pipeline flush, :func:`k2.launcher.planning.comm.fsdp_exposed`), and the
**optimizer step** (:mod:`k2.launcher.planning.optimizer_time`).

What-if settings (``plan.what_if.*``), for comparing with published runs only (``k2-train`` has none of
them; :mod:`k2.launcher.planning.what_if`): ``fp8_gemm`` (GEMMs at the FP8 rate), ``fsdp`` (FSDP2 under
torch's pipelining: :func:`k2.launcher.planning.comm.fsdp_exposed`), ``dualpipe``,
``deepep`` (FP8 dispatch when ``fp8_gemm``, a token crosses to each remote node once: NVLink forwarding),
``node_limit`` (DeepSeek-V3's routing to at most M nodes), ``pipeline_flushes`` (gradient accumulation over
that many pipeline schedules, each with its own fill and drain), ``mtp_layers`` (multi-token-prediction
modules on the stage holding the loss: :meth:`StageModel.mtp`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k2.config.access import setting as _g
from k2.launcher.planning.comm import (crosses_nodes, ep_alltoall, fsdp_exposed, host_copy_seconds, p2p_seconds,
                                      ring_seconds)
from k2.launcher.planning.hardware import HardwareProfile
from k2.launcher.planning.operator_counts import ATTENTION_KERNELS, OPERATORS
from k2.launcher.planning.optimizer_time import optimizer_time
from k2.launcher.planning.what_if import WhatIf, tp_group_profile
from k2.model.kernels import KernelRates, attention_seconds, elementwise_seconds, gemm_seconds, grouped_gemm_seconds
from k2.schedules.pipeline_sim import simulate

#: element-wise backward bytes per forward byte: it reads the saved input and the output gradient and
#: writes the input gradient
BACKWARD_BYTES_FACTOR = 1.5
DEEPSEEK_COMM_SMS = 20  # SMs DeepSeek-V3 gives to communication out of 132 (arXiv 2412.19437 section 3.2.2)

TERMS = ("gemm", "attention", "non_gemm", "ep_comm", "recompute", "offload", "schedule")


@dataclass
class StepTime:
    """One step's time and its breakdown on the busiest PP rank (seconds).

    Attributes:
        step_s: the step's seconds.
        breakdown: seconds per term: compute by kind (``gemm``, ``attention``, ``non_gemm``), exposed
            communication by kind (``ep_comm``, ``pp_p2p`` within ``bubble``, ``dp_grad_reduce_scatter``,
            ``dp_param_all_gather``, ``muon_gather``), ``recompute``, ``offload`` (exposed host copies of
            activations), ``bubble`` (idle time of the busiest PP rank in the simulated schedule, its waits
            for PP sends included), ``optimizer`` (Newton-Schulz + update) and ``optimizer_offload``. They
            sum to ``step_s``.
        F, B, W: per virtual stage the seconds of one microbatch's forward / input gradient / weight
            gradient (what the simulator ran).
        p2p_s: one PP send.
        sim: the simulated pipeline (:class:`k2.schedules.pipeline_sim.PipelineResult`).
        makespan: the pipeline's seconds (extrapolated past the simulated microbatches).
        recompute_s: what recompute adds (``breakdown['recompute']``).
    """

    step_s: float
    breakdown: dict[str, float]
    F: list
    B: list
    W: list
    p2p_s: float
    sim: Any
    makespan: float
    recompute_s: float
    what_if: list = field(default_factory=list)


def _shapes(model_cfg):
    g = lambda k, d=None: _g(model_cfg, k, d)  # noqa: E731
    h, H = int(g("hidden_size")), int(g("num_attention_heads"))
    d_qk, d_r, d_v = int(g("qk_head_dim")), int(g("qk_pos_emb_head_dim")), int(g("v_head_dim"))
    r_q, r_kv = g("q_lora_rank"), int(g("kv_lora_rank"))
    q = [(h, int(r_q)), (int(r_q), H * (d_qk + d_r))] if r_q else [(h, H * (d_qk + d_r))]
    up = [q[-1]] if r_q else []
    up.append((r_kv, H * (d_qk + d_v)))
    proj = q + [(h, r_kv + d_r), (r_kv, H * (d_qk + d_v)), (H * d_v, h)]
    E = int(g("num_moe_experts") or 0)
    return {
        "h": h, "H": H, "d_qk": d_qk, "d_r": d_r, "d_v": d_v, "r_q": int(r_q or 0), "r_kv": r_kv,
        "attn": proj, "up": up, "E": E, "k": int(g("moe_router_topk", 0) or 0) if E else 0,
        "f": int(g("ffn_hidden_size")), "f_e": int(g("moe_ffn_hidden_size") or 0),
        "f_s": int(g("moe_shared_expert_intermediate_size") or 0), "V": int(g("vocab_size")),
        "groups": int(g("moe_router_num_groups") or 0), "group_topk": int(g("moe_router_group_topk") or 0),
    }


def nongemm_bytes_per_token(s: dict, kind: str, act_bytes: float) -> float:
    """Bytes the element-wise kernels of one layer's forward read and write per token.

    ``kind``: ``attention`` (input RMSNorm 2h, q / kv latent RMSNorms 2 r_q + 2 r_kv, RoPE on q and the
    shared key 2 (H + 1) d_r, assembling q and k from their nope / rope parts 4 H (d_qk + d_r), the residual
    add 3h), ``dense_mlp`` (RMSNorm 2h, SwiGLU 3f, residual 3h), ``moe`` (RMSNorm 2h, router scores and
    top-k 4E in FP32, permutation 2kh, SwiGLU of the k routed and the shared expert 3 (k f_e + f_s),
    unpermutation and weighted sum (k + 1) h, adding the shared expert 3h, residual 3h), ``loss`` (final
    RMSNorm 2h, softmax cross-entropy over the FP32 logits: 3V); times ``act_bytes`` per element (FP32
    terms at 4).
    """
    h, H, k = s["h"], s["H"], s["k"]
    if kind == "attention":
        n = 2 * h + 2 * s["r_q"] + 2 * s["r_kv"] + 2 * (H + 1) * s["d_r"] + 4 * H * (s["d_qk"] + s["d_r"]) + 3 * h
        return n * act_bytes
    if kind == "dense_mlp":
        return (2 * h + 3 * s["f"] + 3 * h) * act_bytes
    if kind == "moe":
        n = 2 * h + 2 * k * h + 3 * (k * s["f_e"] + s["f_s"]) + (k + 1) * h + 3 * h + 3 * h
        return n * act_bytes + 4 * s["E"] * 4
    if kind == "loss":
        return 2 * h * act_bytes + 3 * s["V"] * 4
    raise ValueError(kind)


def _add(d: dict, key: str, v: float) -> None:
    d[key] = d.get(key, 0.0) + v


class StageModel:
    """Per-layer costs of one phase on one layout: :func:`step_time` drives it, and
    :mod:`k2.launcher.planning.trace_rates` prices a published trace's chunk with it (seconds)."""

    def __init__(self, model_cfg, fl, dims, *, tokens: int, profile: HardwareProfile, rates: KernelRates,
                 act_bytes: float, grouped: bool, what_if: WhatIf, recompute):
        self.s, self.fl, self.dims, self.T = _shapes(model_cfg), fl, dims, tokens
        self.profile, self.rates, self.a = profile, rates, act_bytes
        self.grouped, self.wi, self.recompute = grouped, what_if, set(recompute or ())
        self.tp_comm = 0.0

    # ---- one layer: {"F": {...}, "B": {...}, "W": {...}} seconds per term
    def _gemms(self, shapes, out: dict, m: float | None = None, groups: int = 1, tag: str = "gemm",
               rates: KernelRates | None = None) -> dict:
        T = self.T if m is None else m
        r = rates or self.rates
        for k, n in shapes:
            if groups > 1 and self.grouped:
                f, b, w = (grouped_gemm_seconds(groups, T, k, n, r), grouped_gemm_seconds(groups, T, n, k, r),
                           grouped_gemm_seconds(groups, k, T, n, r))
            else:
                f = groups * gemm_seconds(T, k, n, r)
                b = groups * gemm_seconds(T, n, k, r)
                w = groups * gemm_seconds(k, T, n, r)
            _add(out["F"], tag, f)
            _add(out["B"], tag, b)
            _add(out["W"], tag, w)
        return out

    def _nongemm(self, kind: str, out: dict, experts: int = 0, rates: KernelRates | None = None) -> None:
        """The element-wise operators of ``kind``: their bytes at the memory rate plus one launch each
        (:data:`OPERATORS`; ``experts``: megatron's sequential experts, each with its own operators)."""
        nbytes = nongemm_bytes_per_token(self.s, kind, self.a) * self.T
        per_expert = OPERATORS["moe_per_expert"]
        f_ops, b_ops = (n + experts * e for n, e in zip(OPERATORS[kind], per_expert))
        r = rates or self.rates
        _add(out["F"], "non_gemm", elementwise_seconds(nbytes, f_ops, r))
        _add(out["B"], "non_gemm", elementwise_seconds(BACKWARD_BYTES_FACTOR * nbytes, b_ops, r))

    def attention_gemms(self, out: dict, tag: str = "gemm") -> None:
        """MLA's projections (down, up, output): their GEMMs added to ``out`` under ``tag``."""
        self._gemms(self.s["attn"], out, tag=tag)

    def expert_gemms(self, out: dict, ep: int, expert_tag: str = "gemm", shared_tag: str = "gemm") -> tuple:
        """A MoE layer's routed experts (``E / ep`` local ones as one grouped GEMM at ``T k ep / E`` tokens
        each, balanced routing) and shared expert into ``out``; returns (local experts, their tokens)."""
        s = self.s
        local, m = max(1, s["E"] // ep), self.T * s["k"] * ep / s["E"]
        self._gemms([(s["h"], 2 * s["f_e"]), (s["f_e"], s["h"])], out, m=m, groups=local, tag=expert_tag)
        if s["f_s"]:
            self._gemms([(s["h"], 2 * s["f_s"]), (s["f_s"], s["h"])], out, tag=shared_tag)
        return local, m

    def up_proj_recompute_s(self) -> float:
        """Seconds of MLA's up-projections run again in the backward (``memory.recompute`` ``mla_up_proj``)."""
        return sum(gemm_seconds(self.T, k, n, self.rates) for k, n in self.s["up"])

    def layer(self, i: int) -> dict:
        s, T, r = self.s, self.T, self.rates
        out = {"F": {}, "B": {}, "W": {}}
        self.attention_gemms(out)
        if self.tp_comm:
            _add(out["F"], "tp_comm", self.tp_comm)
            _add(out["B"], "tp_comm", self.tp_comm)
        core = self.fl.attention_core * T
        _add(out["F"], "attention", attention_seconds(core, r, ATTENTION_KERNELS[0]))
        _add(out["B"], "attention", attention_seconds(2 * core, r, ATTENTION_KERNELS[1]))
        self._nongemm("attention", out)
        rec = 0.0
        if "mla_up_proj" in self.recompute:
            rec += self.up_proj_recompute_s()
        if "layernorm" in self.recompute:
            rec += elementwise_seconds(2 * (s["h"] + s["r_q"] + s["r_kv"]) * self.a * T, 3, r)
        if self.fl.moe_pattern[i]:
            self._gemms([(s["h"], s["E"])], out)  # the router
            local, m = self.expert_gemms(out, self.dims.ep)
            self._nongemm("moe", out, 0 if self.grouped else local)
            comm = self._ep_comm()
            _add(out["F"], "ep_comm", comm)
            _add(out["B"], "ep_comm", comm)
            if "moe_down_proj" in self.recompute:
                rec += grouped_gemm_seconds(local, m, s["f_e"], s["h"], r) if self.grouped else \
                    local * gemm_seconds(m, s["f_e"], s["h"], r)
            if "swiglu" in self.recompute:
                rec += elementwise_seconds(3 * (s["k"] * s["f_e"] + s["f_s"]) * self.a * T, 2, r)
        else:
            self._gemms([(s["h"], 2 * s["f"]), (s["f"], s["h"])], out)
            self._nongemm("dense_mlp", out)
            if "swiglu" in self.recompute:
                rec += elementwise_seconds(3 * s["f"] * self.a * T, 1, r)
        self._nongemm_floor(out)
        if "layer" in self.recompute:
            rec = sum(out["F"].values())  # the whole forward again (its all-to-alls too)
        _add(out["B"], "recompute", rec)
        return out

    def _nongemm_floor(self, out: dict) -> None:
        """The profile's ``nongemm_share``: non-GEMM time at least that share of the pass's compute stream
        (GEMMs + attention + non-GEMM), per pass."""
        share = self.profile.nongemm_share
        if share <= 0:
            return
        for ph in ("F", "B"):
            gemm = (out[ph].get("gemm", 0.0) + out[ph].get("attention", 0.0)
                    + (out["W"].get("gemm", 0.0) if ph == "B" else 0.0))
            out[ph]["non_gemm"] = max(out[ph].get("non_gemm", 0.0), share / (1 - share) * gemm)

    def _node_limit(self) -> int | None:
        """Nodes a token may visit: ``plan.what_if.node_limit``, else the model's group-limited routing
        (``moe_router_num_groups`` groups, ``moe_router_group_topk`` chosen) when the EP group's nodes hold
        one group each (DeepSeek-V3's node-limited routing, arXiv 2412.19437 section 2.1.2)."""
        if self.wi.node_limit:
            return int(self.wi.node_limit)
        groups, topk = self.s["groups"], self.s["group_topk"]
        per_node = max(1, min(self.dims.ep, self.profile.gpus_per_node))
        nodes = -(-self.dims.ep // per_node)
        return topk if groups and topk and nodes == groups else None

    def _ep_comm(self) -> float:
        """Exposed seconds of one MoE layer's dispatch + combine in one pass (module docstring)."""
        s, d, wi = self.s, self.dims, self.wi
        dispatch_bytes = (1 + 4 / 128) if (wi.deepep and wi.fp8_gemm) else self.a  # FP8 + a scale per 128
        a2a = [ep_alltoall(self.T, s["k"], s["h"], d.ep, d.tp, self.profile, bytes_per_element=b,
                           dedup_nodes=wi.deepep, node_limit=self._node_limit()) for b in (dispatch_bytes, self.a)]
        return sum(x.seconds for x in a2a)

    def embedding(self) -> dict:
        """The word embedding: a gather of ``T`` rows forward; backward its dense ``[V, h]`` FP32
        gradient written and added (megatron's embedding backward, then the gradient buffer)."""
        out = {"F": {}, "B": {}, "W": {}}
        h, V = self.s["h"], self.s["V"]
        f_ops, b_ops = OPERATORS["embedding"]
        r = self.profile.part_rates(self.rates, "embedding")
        _add(out["F"], "non_gemm", elementwise_seconds(2 * self.T * h * self.a, f_ops, r))
        _add(out["B"], "non_gemm", elementwise_seconds(self.T * h * self.a + 3 * V * h * 4, b_ops, r))
        return out

    def loss(self) -> dict:
        """The final norm, the output layer and the loss (their operators at the profile's ``loss`` cost)."""
        out = {"F": {}, "B": {}, "W": {}}
        r = self.profile.part_rates(self.rates, "loss")
        self._gemms([(self.s["h"], self.s["V"])], out, rates=r)
        self._nongemm("loss", out, rates=r)
        self._nongemm_floor(out)
        return out

    def mtp(self) -> dict:
        """One multi-token-prediction module on the stage holding the loss (``plan.what_if.mtp_layers``;
        DeepSeek-V3, arXiv 2412.19437 section 2.2): the next token's embedding gathered (2h), the RMSNorms
        of it and of the hidden state (2 x 2h) and their concatenation (4h) in 4 operators, the projection
        ``[T, 2h] x [2h, h]``, one MoE transformer block as the model's (its all-to-alls and recompute sites
        included) and the shared output head and loss again (:meth:`loss`)."""
        out = {"F": {}, "B": {}, "W": {}}
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


def _stage_totals(model: StageModel, layers: list[int], has_loss: bool, cache: dict,
                  has_embedding: bool = False) -> dict:
    """Seconds per pass and term of one microbatch on a virtual stage holding ``layers`` (+ the embedding,
    the loss).
    Layers of one kind cost the same: ``cache`` keeps one per kind."""
    tot = {"F": {}, "B": {}, "W": {}}
    parts = []
    for i in layers:
        key = int(model.fl.moe_pattern[i])
        if key not in cache:
            cache[key] = model.layer(i)
        parts.append(cache[key])
    if has_embedding:
        if "embedding" not in cache:
            cache["embedding"] = model.embedding()
        parts.append(cache["embedding"])
    if has_loss:
        if "loss" not in cache:
            cache["loss"] = model.loss()
        parts.append(cache["loss"])
        if model.wi.mtp_layers:
            if "mtp" not in cache:
                cache["mtp"] = model.mtp()
            parts += [cache["mtp"]] * model.wi.mtp_layers
    for p in parts:
        for ph in tot:
            for k, v in p[ph].items():
                _add(tot[ph], k, v)
    return tot


def _hide_behind(comm: float, compute: float) -> float:
    return max(0.0, comm - compute)


def step_time(cfg, dims, counts, fl, *, tokens: int, num_microbatches: int, recompute=(), offload_bytes=None,
              activation_bytes=None, profile: HardwareProfile, max_microbatches: int | None = None) -> StepTime:
    """The step time of one phase on one layout, with its breakdown (module docstring).

    Args:
        cfg: the config (``model``, ``optim``, ``train.precision``, ``pipeline.decouple_wgrad``,
            ``plan.what_if``, ``model.moe_grouped_gemm``).
        dims: :class:`k2.parallel.dims.ParallelDims`.
        counts: :class:`k2.model.params.ModelParams` (parameters per GPU for the DP traffic and optimizer).
        fl: :class:`k2.model.flops.FlopsPerToken` at the phase's context length.
        tokens: tokens per microbatch (``micro_batch_size x seq_length``).
        num_microbatches: microbatches per step per DP rank.
        recompute: ``memory.recompute`` sites of the phase.
        offload_bytes: per virtual stage the bytes one microbatch offloads to the host (None = 0).
        activation_bytes: per virtual stage the GPU bytes one microbatch keeps (for the simulator).
        profile: the :class:`HardwareProfile`.
        max_microbatches: simulate at most this many (a multiple of pp) and extrapolate the rest at the
            busiest rank's per-microbatch time (``plan.search``).

    Returns:
        :class:`StepTime`.
    """
    wi = WhatIf.from_config(cfg)
    gpu_profile = profile
    if wi.tp > 1:
        profile = tp_group_profile(profile, wi.tp)
    precision = str(cfg.train.precision)
    fraction = (132 - DEEPSEEK_COMM_SMS) / 132 if wi.dualpipe else 1.0
    rates = profile.rates(precision, fp8_gemm=wi.fp8_gemm, compute_fraction=fraction)
    act_bytes = 4.0 if precision == "fp32" else 2.0
    grouped = cfg.model.get("moe_grouped_gemm") if hasattr(cfg.model, "get") else None
    grouped = (precision == "bf16") if grouped is None else bool(grouped)
    model = StageModel(cfg.model, fl, dims, tokens=tokens, profile=profile, rates=rates, act_bytes=act_bytes,
                        grouped=grouped, what_if=wi, recompute=recompute)
    # sequence-parallel TP (what-if): 2 all-gathers + 2 reduce-scatters of T x h per layer and pass, NVLink
    model.tp_comm = 4 * ring_seconds(tokens * model.s["h"] * act_bytes, wi.tp, False, gpu_profile) if wi.tp > 1 else 0.0
    S = dims.pp * dims.vpp
    cache: dict = {}
    kinds = [_stage_totals(model, dims.layout[r][v], dims.stage_has_loss(r, v), cache, dims.stage_has_embedding(r, v))
             for v in range(dims.vpp) for r in range(dims.pp)]
    # the schedule's own work per microbatch and virtual stage (a measured CPU profile), half in each pass
    for st in kinds:
        for ph in ("F", "B"):
            _add(st[ph], "schedule", profile.microbatch_overhead_us * 1e-6 / 2)
    # offloaded activations: out during F, back during B, hidden behind the pass's compute
    off = list(offload_bytes) if offload_bytes is not None else [0.0] * S
    for st, nbytes in zip(kinds, off):
        t = host_copy_seconds(nbytes, profile)
        st["F"]["offload"] = _hide_behind(t, sum(st["F"].values()))
        st["B"]["offload"] = _hide_behind(t, sum(st["B"].values()) + sum(st["W"].values()))
    if wi.dualpipe:  # EP traffic overlapped with the paired microbatch's opposite pass
        for st in kinds:
            f_comp = sum(x for k, x in st["F"].items() if k not in ("ep_comm", "offload"))
            b_comp = sum(x for k, x in st["B"].items() if k not in ("ep_comm", "offload")) + sum(st["W"].values())
            st["F"]["ep_comm"] = _hide_behind(st["F"].get("ep_comm", 0.0), b_comp)
            st["B"]["ep_comm"] = _hide_behind(st["B"].get("ep_comm", 0.0), f_comp)
    F = [sum(st["F"].values()) for st in kinds]
    B = [sum(st["B"].values()) for st in kinds]
    W = [sum(st["W"].values()) for st in kinds]
    world_span = dims.world_size // dims.pp
    # consecutive PP ranks are world / pp ranks apart: on other nodes once that is a node or more
    p2p = p2p_seconds(tokens * model.s["h"] * act_bytes, world_span >= profile.gpus_per_node, profile)
    # per pipeline flush (what-if pipeline_flushes; a flush keeps at least pp microbatches)
    flushes = max(1, min(wi.pipeline_flushes, num_microbatches // dims.pp))
    m = -(-num_microbatches // flushes)
    m_sim = (m if max_microbatches is None or m <= max_microbatches
             else max(dims.pp, max_microbatches // dims.pp * dims.pp))
    sim = simulate(dims.pp, dims.vpp, m_sim, F, B, W, decouple_wgrad=bool(cfg.pipeline.decouple_wgrad),
                   p2p_time=p2p if dims.pp > 1 else 0.0, activation_bytes=activation_bytes)
    held = [_stages_held(r, dims.pp, dims.vpp, wi.dualpipe) for r in range(dims.pp)]
    period = [sum(w * (F[i] + B[i] + W[i]) for i, w in held[r]) for r in range(dims.pp)]
    busiest = max(range(dims.pp), key=lambda r: period[r])
    makespan = flushes * (sim.makespan + (m - m_sim) * period[busiest])
    m = num_microbatches
    busy = m * period[busiest]
    if wi.dualpipe and dims.pp > 1:  # DualPipe's bubble (table 2): (PP/2 - 1)(F&B + B - 3W), B the full backward
        f, b, w = (sum(x * X[i] for i, x in held[busiest]) for X in (F, [p + q for p, q in zip(B, W)], W))
        makespan = busy + max(0.0, (dims.pp / 2 - 1) * (f + b + b - 3 * w))
    breakdown = {k: 0.0 for k in TERMS + (("tp_comm",) if wi.tp > 1 else ())}
    for i, x in held[busiest]:
        for ph in ("F", "B", "W"):
            for k, y in kinds[i][ph].items():
                breakdown[k] += m * x * y
    breakdown["bubble"] = makespan - busy
    # after the pipeline: DP traffic and the optimizer of the busiest PP rank's GPU
    layers, emb, loss = dims.pp_rank_contents(busiest)
    if wi.dualpipe and dims.pp > 1 and dims.vpp == 1:  # the rank keeps both its stages' parameters
        l2, e2, s2 = dims.pp_rank_contents(dims.pp - 1 - busiest)
        layers, emb, loss = sorted(set(layers) | set(l2)), emb or e2, loss or s2
    per_gpu = counts.stage(layers, emb, loss, ep=dims.ep)
    expert = sum(counts.moe_pattern[i] for i in layers) * counts.routed_experts // dims.ep
    dense = per_gpu - expert
    cross = crosses_nodes(world_span, profile)
    # bytes per parameter: ZeRO-1's FP32 gradient buffers, BF16 parameters; FSDP as AutoModel ran it: the
    # dense gradients reduced in FP32 (reduce_dtype), the experts' in their BF16 dtype (no mixed-precision
    # policy on their fully_shard), both gathered in BF16 (fsdp_exposed)
    rs = (ring_seconds(4 * dense, dims.dp, cross, profile)
          + ring_seconds((2 if wi.fsdp else 4) * expert, dims.expert_dp, cross, profile))
    ag = (ring_seconds(2 * dense, dims.dp, cross, profile) + ring_seconds(2 * expert, dims.expert_dp, cross, profile))
    if wi.fsdp:
        fwd = -(-num_microbatches // flushes) * sum(
            w * sum(x for k, x in kinds[i]["F"].items() if k not in ("ep_comm", "offload")) for i, w in held[busiest])
        rs, ag = fsdp_exposed(rs, ag, flushes=flushes, layers=len(layers), forward_compute_s=fwd)
    breakdown["dp_grad_reduce_scatter"] = rs
    breakdown["dp_param_all_gather"] = ag
    nrates = profile.part_rates(profile.rates("bf16" if precision != "fp32" else "fp32"), "optimizer")
    tensors = _tensors(counts, layers, dims.ep, emb, loss, bool(model.s["r_q"]))
    opt = optimizer_time(str(cfg.optim.name), cfg.model, dims, layers, counts.moe_pattern, dense_params=dense,
                         expert_params=expert, tensors=tensors, profile=profile, rates=nrates,
                         offload_fraction=float(cfg.optim.offload_fraction), fused=precision != "fp32")
    breakdown["optimizer"] = opt.newton_schulz + opt.update
    breakdown["muon_gather"] = opt.muon_gather
    breakdown["optimizer_offload"] = opt.offload
    breakdown["schedule"] += profile.step_overhead_us * 1e-6
    step = makespan + rs + ag + opt.total + profile.step_overhead_us * 1e-6
    return StepTime(step_s=step, breakdown=breakdown, F=F, B=B, W=W, p2p_s=p2p, sim=sim, makespan=makespan,
                    recompute_s=breakdown["recompute"], what_if=wi.labels())


def _stages_held(rank: int, pp: int, vpp: int, dualpipe: bool) -> list[tuple[int, float]]:
    """The virtual stages (index ``v * pp + rank``) a PP rank runs and the share of the microbatches each
    takes: megatron's (interleaved) 1F1B, every microbatch through each of the rank's ``vpp`` stages;
    DualPipe (``vpp`` 1), stage ``rank`` for the microbatches fed from one end and stage ``pp - 1 - rank``
    for those fed from the other, half each (arXiv 2412.19437 section 3.2.1, figure 5: the shallowest
    and the deepest layers, embedding and output head, on the same rank); DualPipe has no virtual stages,
    so with ``vpp`` > 1 the interleaved order stands."""
    if dualpipe and pp > 1 and vpp == 1:
        return [(rank, 0.5), (pp - 1 - rank, 0.5)]
    return [(v * pp + rank, 1.0) for v in range(vpp)]


def _tensors(counts, layers, ep: int, emb: bool, loss: bool, q_lora: bool) -> int:
    """Parameter tensors on one GPU of a PP rank (for per-tensor optimizer launches): per layer MLA's
    projections and norms (8 with a q LoRA rank, else 6: counted on k2-train's modules), a dense MLP's 2 +
    its norm, an MoE layer's norm, router, shared expert 2 and 2 per local expert (megatron's sequential
    experts and its grouped module alike); the embedding; the output layer and the final norm."""
    n = 0
    E = getattr(counts, "num_experts", 0) or 0
    attn = 8 if q_lora else 6
    for i in layers:
        n += attn
        n += (2 + 2 + 2 * (E // ep)) if counts.moe_pattern[i] else 3
    return n + (1 if emb else 0) + (2 if loss else 0)
