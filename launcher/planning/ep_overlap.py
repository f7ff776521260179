"""``k2-plan``'s model of ``pipeline.ep_overlap``: megatron-core's combined-1F1B schedule, in which the EP
all-to-alls of one microbatch are in flight while another microbatch computes (K2 report, "Training
system": interleaved 1F1B with extra warm-up micro-batches so that the all-to-all is covered by
computation).

What the trainer runs (megatron-core 0.19.2, ``k2.schedules.ep_overlap``), and so what this models:

* **Which steps.** Every step of the schedule runs through ``combined_forward_backward_step``: the
  warm-up forwards alone, then in the steady state one microbatch's forward and another's backward as
  one *pair*, then the cool-down backwards alone; megatron adds one warm-up microbatch per PP rank so
  that the two halves of a pair are independent (``pipeline_parallel/schedules.py``
  ``get_pp_rank_microbatches``; the order is :func:`k2.launcher.planning.pipeline_sim.rank_order`'s).
* **Inside a pair** (``models/common/model_chunk_schedule_plan.py``): forward layer ``i`` of the forward
  chunk runs with backward layer ``n_b - 1 - i`` of the backward chunk, the longer chunk's leftover
  layers alone after; within one layer pair (``TransformerLayerSchedulePlan.run``) the nodes
  (:mod:`k2.launcher.planning.stage_model`) are issued in the order of :data:`PAIR_ORDER`. Each node waits
  for the previous node of its own microbatch (one CUDA event per microbatch's chunk plan,
  ``pipeline_parallel/utils.py`` ``ScheduleNode.stream_acquire_context``); the delayed weight gradients
  (``mlp_dw``, ``attn_dw``: ``backward_dw``, with ``pipeline.decouple_wgrad``; otherwise inside their
  backward node) record no event. The chunk's first layer's ``attn_dw`` runs after the pair's
  point-to-point sends, then the loss forward and the embedding backward.
* **Two streams**, by the profile's ``comm_stream`` (:mod:`k2.launcher.planning.two_streams` runs them):
  ``device`` (CUDA: a node starts as soon as its input is ready and its stream is free; compute nodes on
  one stream, dispatch and combine on the other, each stream in issue order; an all-to-all kernel
  occupies SMs, the profile's ``alltoall_comm_units`` for NCCL or ``deepep_comm_units`` for DeepEP out of
  ``compute_units``, so a compute node running beside it is slower by that share: term ``ep_comm_sms``);
  ``host_thread`` (``k2.parallel.comm_stream``, what ``k2-train`` runs on CPU): the same, plus a
  communication node starts no earlier than the host issues it, after the compute nodes before it in
  issue order (the host runs compute synchronously; the trainer issues each dispatch right after the node
  it waits for, :data:`HOST_PAIR_ORDER`, where a GPU's stream would start it), and the communication
  thread's own compute (the combine's un-permutation and residual) takes its seconds from the CPU the
  compute nodes run on (a compute node running meanwhile is longer by as much), and so does the host's
  work on each all-to-all while it is on the wire (gloo's threads, the kernel's TCP and shaping: the
  profile's ``alltoall_host_cpu_share`` of the CPU, measured on the link; term ``ep_comm_host``). Without
  the overlap that work sits inside the all-to-all's own time.
* **The token-count all-gather** (megatron's alltoall dispatcher, before each dispatch: term
  ``ep_token_counts``, priced by :meth:`k2.launcher.planning.stage_model.StageModel.token_counts_s`) ends
  the forward's ``attn`` node on the compute stream; where an all-to-all is on the wire then, its messages
  queue behind that all-to-all's bytes and it waits longer (the profile's ``network_loaded_latency_us``:
  :meth:`~k2.launcher.planning.stage_model.StageModel.token_counts_queue_s`). Without the overlap nothing
  is on the wire when it runs.
* **What is exposed** is the time the compute stream waits: a wait for an all-to-all is ``ep_comm``
  (attributed to the all-to-alls in flight), a wait for the communication stream's compute is
  ``non_gemm``. Steps of one microbatch (warm-up, cool-down) expose their all-to-alls, as the schedule
  without the overlap does (with ``pipeline.decouple_wgrad`` on a GPU a backward's ``mlp_dw`` still runs
  under its dispatch). Activation offload copies (a copy engine) are exposed only beyond the step's time.

Each dispatch and combine on the communication stream takes its wire time plus its wait for the last rank
of its group to call it (the profile's ``alltoall_peer_wait_us``,
:meth:`k2.launcher.planning.stage_model.StageModel._ep_alltoalls`), as it does exposed without the overlap.

Not modelled: the schedule plans' own host cost (the profile's ``microbatch_overhead_us`` is the
schedule without the overlap), the memory bandwidth an all-to-all's kernel takes beside its SMs; on a host
thread, the smaller share of a shared CPU the rank's compute gets while the overlap keeps it busy, and
megatron's second, small all-to-all in each dispatch (the routing probabilities), both measured by
``k2-bench bench=ep_overlap`` on its shaped link, whose prediction with the overlap on is therefore a
bound (docs/performance_model.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k2.launcher.planning.hardware import DEVICE, HOST_THREAD  # noqa: F401  (DEVICE: the stream values, with it)
from k2.launcher.planning.two_streams import A2A_KINDS, Node, StepCost, _add, run_nodes

if TYPE_CHECKING:
    from k2.config.schema import K2Config
#: :func:`overlap_applies`' reason when the setting is off
NOT_REQUESTED = "pipeline.ep_overlap=false"
#: megatron's issue order of one layer pair (``TransformerLayerSchedulePlan.run``): f = the forward
#: microbatch, b = the backward one
PAIR_ORDER = (
    ("b", "combine"),
    ("f", "attn"),
    ("b", "mlp"),
    ("f", "dispatch"),
    ("b", "mlp_dw"),
    ("b", "dispatch"),
    ("f", "mlp"),
    ("f", "combine"),
    ("b", "attn"),
    ("b", "attn_dw"),
)
#: the issue order of ``k2-train`` on CPU (``k2.parallel.comm_stream``'s layer pair): megatron's nodes and
#: stream orders, each dispatch issued right after the node it waits for
HOST_PAIR_ORDER = (
    ("b", "combine"),
    ("f", "attn"),
    ("f", "dispatch"),
    ("b", "mlp"),
    ("b", "dispatch"),
    ("b", "mlp_dw"),
    ("f", "mlp"),
    ("f", "combine"),
    ("b", "attn"),
    ("b", "attn_dw"),
)


# ---------------------------------------------------------------- the nodes of one stage's microbatch


@dataclass
class StagePlan:
    """One virtual stage's work for one microbatch, by schedule node.

    Attributes:
        layers: per layer, in order, :meth:`k2.launcher.planning.stage_model.StageModel.layer_nodes`.
        pre_f, post_f: before the first layer's forward (the embedding; the schedule's own work) and
            after the last (the loss, the MTP what-if): ``{"F": terms}``.
        pre_b, post_b: before the backward's first node (the loss's backward, its weight gradient) and
            after the last (the embedding's backward): ``{"B": terms, "W": terms}``.
        offload_f, offload_b: seconds of the activation copies to the host in the forward and back in
            the backward.
    """

    layers: list
    pre_f: dict
    post_f: dict
    pre_b: dict
    post_b: dict
    offload_f: float = 0.0
    offload_b: float = 0.0


def _extra(terms: dict, micro: str, name: str) -> list[Node]:
    """A stage's non-layer work as one compute node, its all-to-alls (MTP) as one exposed node after it."""
    comp = {k: v for k, v in terms.items() if k != "ep_comm" and v}
    out = [Node(name, micro, terms=comp)] if comp else []
    if terms.get("ep_comm"):
        out.append(Node(name, micro, comm=True, wire=terms["ep_comm"], kind="other"))
    return out


def _merged(*parts: dict) -> dict:
    out: dict = {}
    for p in parts:
        for k, v in p.items():
            _add(out, k, v)
    return out


def layer_forward(nodes: dict) -> dict[str, Node]:
    """A layer's forward nodes (``attn``, ``dispatch``, ``mlp``, ``combine``; no all-to-all in a dense one)."""
    out = {}
    for name, part in nodes.items():
        wire = part["F"].get("ep_comm", 0.0)
        terms = {k: v for k, v in part["F"].items() if k != "ep_comm"}
        comm = name in ("dispatch", "combine")
        out[name] = Node(name, "f", comm=comm, wire=wire, terms=terms, kind=f"{name}_fwd" if comm else "")
    return out


def layer_backward(nodes: dict, decouple_wgrad: bool) -> dict[str, Node]:
    """A layer's backward nodes: ``combine``, ``mlp`` (+ its weight gradient unless decoupled),
    ``mlp_dw``, ``dispatch``, ``attn``, ``attn_dw`` (the delayed weight gradients with ``decouple_wgrad``)."""
    out = {}
    for name, part in nodes.items():
        comm = name in ("dispatch", "combine")
        if comm:
            terms = {k: v for k, v in part["B"].items() if k != "ep_comm"}
            out[name] = Node(name, "b", comm=True, wire=part["B"].get("ep_comm", 0.0), terms=terms, kind=f"{name}_bwd")
        elif decouple_wgrad:
            out[name] = Node(name, "b", terms=dict(part["B"]))
            out[f"{name}_dw"] = Node(f"{name}_dw", "b", terms=dict(part["W"]), event=False)
        else:
            out[name] = Node(name, "b", terms=_merged(part["B"], part["W"]))
    return out


def step_nodes(f: StagePlan | None, b: StagePlan | None, decouple_wgrad: bool, order: tuple = PAIR_ORDER) -> list[Node]:
    """The nodes of one combined step in issue order (``TransformerModelChunkSchedulePlan.run``, each
    layer pair in ``order``): ``f`` the forward microbatch's stage, ``b`` the backward one's (either
    None)."""
    nodes: list[Node] = []
    if f is not None:
        nodes += _extra(f.pre_f["F"], "f", "pre")
    if b is not None:
        nodes += _extra(_merged(b.pre_b["B"], b.pre_b["W"]), "b", "pre")
    fl = [layer_forward(x) for x in f.layers] if f is not None else []
    bl = [layer_backward(x, decouple_wgrad) for x in reversed(b.layers)] if b is not None else []
    first_dw = None
    for i in range(max(len(fl), len(bl))):
        fw = fl[i] if i < len(fl) else {}
        bw = bl[i] if i < len(bl) else {}
        for micro, name in order:
            node = (fw if micro == "f" else bw).get(name)
            if node is None:
                continue
            if micro == "b" and name == "attn_dw" and i == len(bl) - 1:
                first_dw = node  # after the pair's sends (megatron delays the chunk's first layer's)
                continue
            nodes.append(node)
    if first_dw is not None:
        nodes.append(first_dw)
    if f is not None:
        nodes += _extra(f.post_f["F"], "f", "post")
    if b is not None:
        nodes += _extra(_merged(b.post_b["B"], b.post_b["W"]), "b", "post")
    return nodes


def stage_plans(
    model, dims, schedule_work_half_s: float, copies_s: list, host_s: list | None = None
) -> list[StagePlan]:
    """Per virtual stage its :class:`StagePlan` from ``model``
    (:class:`k2.launcher.planning.stage_model.StageModel`: layers by node, the embedding, the loss, the
    MTP what-if), the pipeline schedule's own work per microbatch (half before each pass), the stage's
    activation copies (``copies_s``: seconds each way) and the host's exposed seconds of its forward and
    backward (``host_s``: per stage ``(forward, backward)``, :mod:`k2.launcher.planning.host_bound`; None =
    none): a pass's compute waits for the host as it does without the overlap, so the combined 1F1B charges
    them on the compute stream too (before each pass's first node)."""
    cache: dict = {}

    def get(key, make):
        if key not in cache:
            cache[key] = make()
        return cache[key]

    none = {"F": {}, "B": {}, "W": {}}
    plans = []
    for v in range(dims.vpp):
        for r in range(dims.pp):
            layers = [
                get(int(model.fl.moe_pattern[i]), lambda i=i: model.layer_nodes(i)) for i in dims.stage_layers[r][v]
            ]
            emb = get("embedding", model.embedding) if dims.stage_has_embedding(r, v) else none
            tail = [get("loss", model.loss)] if dims.stage_has_loss(r, v) else []
            if tail and model.wi.mtp_layers:
                tail += [get("mtp", model.mtp)] * model.wi.mtp_layers
            sched = {"schedule": schedule_work_half_s} if schedule_work_half_s else {}
            host_f, host_b = host_s[v * dims.pp + r] if host_s else (0.0, 0.0)
            plans.append(
                StagePlan(
                    layers=layers,
                    pre_f={"F": _merged(emb["F"], sched, {"host": host_f} if host_f else {})},
                    post_f={"F": _merged(*(x["F"] for x in tail))},
                    pre_b={
                        "B": _merged(*(x["B"] for x in tail), sched, {"host": host_b} if host_b else {}),
                        "W": _merged(*(x["W"] for x in tail)),
                    },
                    post_b={"B": dict(emb["B"]), "W": dict(emb["W"])},
                    offload_f=copies_s[v * dims.pp + r],
                    offload_b=copies_s[v * dims.pp + r],
                )
            )
    return plans


def ep_summary(wire: dict, exposed: dict, by_part: dict | None = None) -> dict:
    """The EP all-to-alls of a step on the busiest rank (seconds): ``total_s``, ``exposed_s``, ``hidden_s``,
    per kind (:data:`A2A_KINDS`, those that occur) ``{total_s, exposed_s, hidden_s}``, and with the overlap
    ``by_part``: the exposed seconds of the warm-up forwards, the steady pairs and the cool-down backwards."""
    kinds = {
        k: {"total_s": wire[k], "exposed_s": exposed[k], "hidden_s": wire[k] - exposed[k]}
        for k in A2A_KINDS
        if wire.get(k) or exposed.get(k)
    }
    total, shown = sum(wire.values()), sum(exposed.values())
    out = {"total_s": total, "exposed_s": shown, "hidden_s": total - shown, "by_kind": kinds}
    if by_part is not None:
        out["by_part"] = dict(by_part)
    return out


@functools.lru_cache(maxsize=4096)
def _run_frozen(
    nodes: tuple, comm_stream: str, offload_s: float, comm_share: float, counts_queue_s: float, wire_slowdown: float
) -> StepCost:
    """:func:`k2.launcher.planning.two_streams.run_nodes` of the nodes given as tuples of their fields (terms as
    ``(term, seconds)`` pairs, in order). Why a cache: the stages of a layout are mostly alike (the same layers),
    and a search prices hundreds of layouts whose steps repeat across stages, phases and the verdict's variants;
    run_nodes is a pure function of exactly these values (the terms' order included, which its sums follow),
    so an equal key gives the same StepCost, and every caller only reads it."""
    return run_nodes(
        [
            Node(name, micro, comm, wire, dict(terms), event, kind)
            for name, micro, comm, wire, terms, event, kind in nodes
        ],
        comm_stream,
        offload_s,
        comm_share,
        counts_queue_s,
        wire_slowdown,
    )


class OverlapCosts:
    """The combined schedule's step costs on one layout (cached): :meth:`forward` and :meth:`backward`
    (one microbatch alone on a stage), :meth:`pair` (a forward on one stage with a backward on another of
    the same rank).

    Args:
        plans: per virtual stage its :class:`StagePlan`.
        comm_stream: the profile's ``comm_stream``.
        decouple_wgrad: ``pipeline.decouple_wgrad``.
        comm_share: the share of the processor an all-to-all on the wire takes from the compute beside it
            (:func:`k2.launcher.planning.two_streams.run_nodes`).
        counts_queue_s: the token-count all-gather's wait behind an all-to-all on the wire (:func:`run_nodes`).
        wire_slowdown: how much longer an all-to-all takes on the wire beside the host's compute
            (``host_thread``; :func:`k2.launcher.planning.two_streams.run_nodes`).
    """

    def __init__(
        self,
        plans: list[StagePlan],
        comm_stream: str,
        decouple_wgrad: bool,
        comm_share: float = 0.0,
        counts_queue_s: float = 0.0,
        wire_slowdown: float = 1.0,
    ):
        self.plans, self.comm_stream, self.decouple_wgrad = plans, comm_stream, decouple_wgrad
        self.comm_share, self.counts_queue_s, self.wire_slowdown = comm_share, counts_queue_s, wire_slowdown
        self._cache: dict = {}

    def _cost(self, sf: int | None, sb: int | None) -> StepCost:
        key = (sf, sb)
        if key not in self._cache:
            f = self.plans[sf] if sf is not None else None
            b = self.plans[sb] if sb is not None else None
            off = (f.offload_f if f else 0.0) + (b.offload_b if b else 0.0)
            order = HOST_PAIR_ORDER if self.comm_stream == HOST_THREAD else PAIR_ORDER
            nodes = step_nodes(f, b, self.decouple_wgrad, order)
            frozen = tuple((n.name, n.micro, n.comm, n.wire, tuple(n.terms.items()), n.event, n.kind) for n in nodes)
            args = (self.comm_stream, off, self.comm_share, self.counts_queue_s, self.wire_slowdown)
            self._cache[key] = _run_frozen(frozen, *args)
        return self._cache[key]

    def forward(self, s: int) -> StepCost:
        return self._cost(s, None)

    def backward(self, s: int) -> StepCost:
        return self._cost(None, s)

    def pair(self, sf: int, sb: int) -> StepCost:
        return self._cost(sf, sb)

    def of(self, op) -> StepCost | None:
        """The cost of a simulated :class:`k2.launcher.planning.pipeline_sim.Op` (None: the backward half of a
        pair, counted with its forward half)."""
        if op.partner >= 0:
            return self.pair(op.stage, op.partner) if op.kind == "F" else None
        return self.forward(op.stage) if op.kind == "F" else self.backward(op.stage)


def rank_costs(costs: OverlapCosts, sim, rank: int) -> dict:
    """Seconds the simulated combined schedule ``sim`` keeps PP rank ``rank`` busy, by term, and its
    all-to-alls by kind and part of the schedule: ``{"busy", "terms", "exposed", "wire", "by_part",
    "pair_exposure", "pair_exposed"}`` (``by_part``: exposed seconds in the warm-up forwards, the steady
    pairs, the cool-down backwards; ``pair_exposure`` / ``pair_exposed``: a steady pair's mean seconds
    beyond its compute stream's work by term / its exposed all-to-all by kind, for :func:`extrapolate`)."""
    out = {
        "busy": 0.0,
        "terms": {},
        "exposed": {k: 0.0 for k in A2A_KINDS},
        "wire": {k: 0.0 for k in A2A_KINDS},
        "by_part": {"warmup": 0.0, "steady": 0.0, "cooldown": 0.0},
    }
    pairs: list[StepCost] = []
    for op in sim.ops:
        c = costs.of(op) if op.rank == rank else None
        if c is None:
            continue
        out["busy"] += c.seconds
        for k, v in c.terms.items():
            _add(out["terms"], k, v)
        for k in A2A_KINDS:
            out["exposed"][k] += c.exposed[k]
            out["wire"][k] += c.wire[k]
        part = "steady" if op.partner >= 0 else ("warmup" if op.kind == "F" else "cooldown")
        out["by_part"][part] += c.terms["ep_comm"]
        if op.partner >= 0:
            pairs.append(c)
    n = max(1, len(pairs))
    out["pair_exposure"] = {
        k: sum(p.terms.get(k, 0.0) - p.compute.get(k, 0.0) for p in pairs) / n for k in out["terms"]
    }
    out["pair_exposed"] = {k: sum(p.exposed[k] for p in pairs) / n for k in A2A_KINDS}
    return out


def extrapolate(costs: OverlapCosts, rc: dict, rank: int, pp: int, vpp: int, microbatches: int) -> dict:
    """``rc`` (:func:`rank_costs` of PP rank ``rank``) with ``microbatches`` more in the steady state: each
    adds its forward and backward on every chunk of the rank (their compute exactly) in ``vpp`` pairs
    exposing what the simulated pairs expose on average. Adds ``cycle``: one more microbatch's seconds."""
    compute: dict = {}
    wire = {k: 0.0 for k in A2A_KINDS}
    for c in range(vpp):
        for step in (costs.forward(c * pp + rank), costs.backward(c * pp + rank)):
            for k, v in step.compute.items():
                _add(compute, k, v)
            for k in A2A_KINDS:
                wire[k] += step.wire[k]
    per = {
        k: compute.get(k, 0.0) + vpp * rc["pair_exposure"].get(k, 0.0) for k in dict.fromkeys([*compute, *rc["terms"]])
    }
    cycle = sum(per.values())
    n = microbatches
    return {
        "busy": rc["busy"] + n * cycle,
        "cycle": cycle,
        "terms": {k: rc["terms"].get(k, 0.0) + n * v for k, v in per.items()},
        "exposed": {k: v + n * vpp * rc["pair_exposed"][k] for k, v in rc["exposed"].items()},
        "wire": {k: v + n * wire[k] for k, v in rc["wire"].items()},
        "by_part": dict(
            rc["by_part"], steady=rc["by_part"]["steady"] + n * vpp * rc["pair_exposure"].get("ep_comm", 0.0)
        ),
    }


def overlap_applies(cfg: K2Config, dims, recompute, what_if) -> tuple[bool, str]:
    """Whether ``pipeline.ep_overlap`` runs in a phase with ``recompute`` (its ``memory.recompute``
    sites) on ``dims``, and why not: megatron's rules (``transformer/transformer_config.py``: EP > 1; with
    PP > 1 only the interleaved schedule), whole-layer and MoE-layer recompute (they re-run the all-to-alls
    in backward, outside the pairs: the trainer runs that phase without the overlap), and the DualPipe what-if (its
    own overlap). Returns ``(applies, reason)``."""
    if not cfg.pipeline.ep_overlap:
        return False, NOT_REQUESTED
    if not cfg.model.num_moe_experts:
        return False, "no MoE layers"
    if what_if.dualpipe:
        return False, "the DualPipe what-if overlaps the all-to-alls its own way"
    if dims.ep <= 1:
        return False, "EP 1: no all-to-all"
    if dims.pp > 1 and dims.vpp <= 1:
        return False, f"PP {dims.pp} without virtual stages (megatron's combined 1F1B is interleaved)"
    rerun = [x for x in ("layer", "moe") if x in set(recompute or ())]
    if rerun:
        return False, f"memory.recompute '{rerun[0]}' re-runs the all-to-alls in backward"
    return True, "on"
