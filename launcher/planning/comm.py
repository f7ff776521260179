"""Communication of one training step for ``k2-plan``'s step-time model: bytes and seconds per GPU.

Placement (megatron-core's rank order ``tp-cp-ep-dp-pp``, :func:`k2.launcher.planning.analysis.pp_rank_of`)
against the profile's NVLink domain (``domain_gpus``: one host's GPUs, or an NVL72 rack's 72), rank by rank
(:mod:`k2.launcher.planning.placement`): an EP group is ``ep`` consecutive ranks (expert TP 1: megatron's
expert rank order ``etp-ep-dp-pp``), on NVLink where it lies inside one domain, partly across the network
where it straddles two (EP64 in a 72-GPU rack); a DP group (and an expert-DP group) lies inside one PP
rank's ``world / pp`` consecutive ranks and leaves the domain when those span two; a PP send crosses
domains wherever consecutive stages sit in different domains. "Across nodes" below means across NVLink
domains (the network).

Rates: a link carries ``bytes / achieved GB/s`` (the profile's measured all-to-all / collective figures,
not the link peaks), plus the profile's per-message latency across nodes. An all-to-all uses the
intra-node and inter-node links at once (NCCL and DeepEP both do), so it takes the longer of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from k2.launcher.planning.hardware import HardwareProfile


@dataclass(frozen=True)
class AllToAll:
    """One EP all-to-all (dispatch or combine of one MoE layer, one microbatch) on one GPU.

    Attributes:
        intra_bytes: bytes sent to GPUs of the same node.
        inter_bytes: bytes sent to other nodes.
        seconds: its time.
    """

    intra_bytes: float
    inter_bytes: float
    seconds: float


def expected_nodes_hit(k: int, nodes: int, node_limit: int | None = None) -> float:
    """Expected number of distinct nodes a token's ``k`` experts live on, experts drawn uniformly over
    ``nodes`` nodes (``1 - (1 - 1/N)^k`` per node); with DeepSeek-V3's node-limited routing at most
    ``node_limit`` (arXiv 2412.19437 section 2.1.2: each token goes to at most M = 4 nodes)."""
    if nodes <= 1:
        return 1.0
    hit = nodes * (1 - (1 - 1 / nodes) ** k)
    return min(hit, node_limit) if node_limit else hit


def ep_alltoall(
    tokens: float,
    k: int,
    hidden: int,
    ep: int,
    profile: HardwareProfile,
    *,
    bytes_per_element: float,
    deepep: bool = False,
    node_limit: int | None = None,
    pieces: tuple[tuple[int, ...], ...] | None = None,
) -> AllToAll:
    """Dispatch (or combine) of ``tokens`` tokens (one GPU's), ``k`` expert copies each, over an EP group of
    ``ep`` consecutive ranks (expert TP 1).

    Each copy of ``hidden`` elements goes to the rank holding its expert; balanced routing sends, from a
    rank whose NVLink domain holds ``c`` of the group's ranks, ``(c - 1) / ep`` of them inside the domain
    and ``(ep - c) / ep`` across domains, at NCCL's all-to-all rates (megatron's ``alltoall`` dispatcher).
    ``deepep`` (megatron's ``flex`` dispatcher, a what-if): DeepEP's rates, and its NVLink forwarding: a
    token crosses the network once per other domain it visits (a domain holding ``d`` of the ``ep`` ranks
    is visited with probability ``1 - (1 - d / ep)^k``; at most ``node_limit`` domains in all,
    :func:`expected_nodes_hit`), then NVLink fans it out. The all-to-all ends with its slowest rank.

    Args:
        pieces: how the layout's EP groups fall across NVLink domains, per distinct pattern the sizes of
            its parts (:func:`k2.launcher.planning.placement.ep_group_pieces`); None: aligned, ``min(ep,
            domain_gpus)`` ranks per domain.

    Returns:
        :class:`AllToAll` (bytes and seconds of the slowest rank).
    """
    if ep <= 1 or tokens <= 0 or k <= 0:
        return AllToAll(0.0, 0.0, 0.0)
    if pieces is None:
        g = max(1, min(ep, profile.domain_gpus))
        pieces = ((g,) * (ep // g) + ((ep % g,) if ep % g else ()),)
    per_copy = hidden * bytes_per_element
    nvlink, network = profile.alltoall_gbps(deepep)
    slowest = AllToAll(0.0, 0.0, -1.0)
    for pattern in pieces:
        for i, c in enumerate(pattern):
            intra = tokens * k * (c - 1) / ep * per_copy
            if deepep:
                others = pattern[:i] + pattern[i + 1 :]
                hits = sum(1 - (1 - d / ep) ** k for d in others)
                if node_limit and others:
                    hits = min(hits, node_limit * len(others) / len(pattern))
                inter = tokens * hits * per_copy
            else:
                inter = tokens * k * (ep - c) / ep * per_copy
            latency = profile.network_latency_us * 1e-6 if inter else 0.0
            seconds = max(intra / (nvlink * 1e9), inter / (network * 1e9) + latency)
            if seconds > slowest.seconds:
                slowest = AllToAll(intra, inter, seconds)
    return slowest


def crosses_nodes(group_span: int, profile: HardwareProfile) -> bool:
    """True when a group spread over ``group_span`` consecutive ranks leaves one NVLink domain."""
    return group_span > profile.domain_gpus


def p2p_seconds(nbytes: float, cross_node: bool, profile: HardwareProfile) -> float:
    """One point-to-point send of ``nbytes`` (a PP activation or its gradient)."""
    if nbytes <= 0:
        return 0.0
    if cross_node:
        return nbytes / (profile.network_gbps * 1e9) + profile.network_latency_us * 1e-6
    return nbytes / (profile.nvlink_gbps * 1e9) + profile.intra_latency_us * 1e-6


def ring_seconds(nbytes: float, group: int, cross_node: bool, profile: HardwareProfile) -> float:
    """A ring reduce-scatter or all-gather of ``nbytes`` (the whole buffer) over ``group`` ranks: each rank
    moves ``(n - 1) / n`` of it (NCCL's bus-bandwidth convention) at the collective rate of the slowest
    link, plus ``n - 1`` message latencies across nodes."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    moved = nbytes * (group - 1) / group
    if cross_node:
        return moved / (profile.network_collective_gbps * 1e9) + (group - 1) * profile.network_latency_us * 1e-6
    return moved / (profile.nvlink_collective_gbps * 1e9) + (group - 1) * profile.intra_latency_us * 1e-6


def host_copy_seconds(nbytes: float, profile: HardwareProfile) -> float:
    """A device <-> host copy of ``nbytes`` (offload) at the profile's host link rate."""
    return max(nbytes, 0.0) / (profile.host_gbps * 1e9)


def fsdp_exposed(
    reduce_scatter_s: float, all_gather_s: float, *, flushes: int, layers: int, forward_compute_s: float
) -> tuple[float, float]:
    """Exposed seconds of FSDP2's DP traffic per step under torch's pipelining, as NeMo AutoModel runs it
    (``plan.what_if.fsdp``): ``(reduce_scatter, all_gather)``.

    Args:
        reduce_scatter_s, all_gather_s: one reduce-scatter of the PP rank's gradients and one all-gather of
            its parameters (seconds, all its virtual stages).
        flushes: pipeline schedules per optimizer step (``schedule.step()`` per gradient-accumulation step).
        layers: layers on the PP rank (FSDP2 units: one per transformer block and one per block's experts).
        forward_compute_s: the rank's forward compute in one flush, all-to-alls excluded (they share the
            NICs with the DP traffic).

    Rules (torch.distributed.pipelining, ``stage.py`` ``perform_reduce_grad`` / earlier releases
    ``backward_maybe_with_nosync``; FSDP2 ``_root_post_backward_final_callback``): within a schedule no
    gradient is reduced and no parameter resharded (``set_requires_gradient_sync(False)``,
    ``set_reshard_after_backward(False)``; AutoModel shards with ``reshard_after_forward=False`` under
    PP); after each stage's last backward of the schedule its gradients are reduce-scattered and its
    parameters resharded, and the compute stream waits for the reductions: **every flush's reduce-scatter
    is exposed**. The next flush all-gathers the parameters again, unit by unit on FSDP2's all-gather stream
    while earlier kernels run: **exposed are the first unit's gather** (one layer's share, nothing queued
    before it) **and what exceeds the flush's forward compute**.
    """
    first = all_gather_s / max(1, layers)
    return flushes * reduce_scatter_s, flushes * (first + max(0.0, all_gather_s - first - forward_compute_s))
