"""Where ``k2-plan``'s process groups fall across NVLink domains.

An NVLink domain is ``domain`` consecutive global ranks (:attr:`k2.launcher.planning.hardware.HardwareProfile.
domain_gpus`: one host's GPUs, or an NVL72 rack's 72). megatron-core orders ranks ``tp-cp-ep-dp-pp`` (experts:
``etp-ep-dp-pp``, expert TP 1), so PP rank ``p`` holds the block ``[p * W / pp, (p + 1) * W / pp)`` of the
``W`` ranks; its EP groups are ``ep`` consecutive ranks from the block's start; its DP and expert-DP groups
lie inside the block; consecutive PP ranks are ``W / pp`` ranks apart.

Where ``domain`` is not a multiple of the group, some groups straddle two domains: EP16, EP32 and EP64 in
a 72-GPU rack, e.g. EP64's second group holds ranks 64-127, 8 of them in the first rack and 56 in the
second. A rank of the smaller piece then sends most of its all-to-all over the network, and an all-to-all
ends with its slowest rank (:func:`k2.launcher.planning.comm.ep_alltoall` takes the pieces).
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["pieces", "ep_group_pieces", "block_crosses", "pp_hop_crosses"]


def pieces(start: int, size: int, domain: int) -> tuple[int, ...]:
    """The sizes of the parts of the ranks ``[start, start + size)`` in each NVLink domain they touch, in
    rank order (one part: the group stays in one domain)."""
    out, r, end = [], start, start + size
    while r < end:
        nxt = min(end, (r // domain + 1) * domain)
        out.append(nxt - r)
        r = nxt
    return tuple(out)


@lru_cache(maxsize=4096)
def ep_group_pieces(world: int, pp: int, ep: int, domain: int) -> tuple[tuple[int, ...], ...]:
    """The distinct ways the EP groups of a layout fall across NVLink domains: for each, the sizes of its
    parts (sorted, largest first). One pattern of one part: every EP group stays on NVLink."""
    span = world // pp
    seen = {
        tuple(sorted(pieces(p * span + j * ep, ep, domain), reverse=True))
        for p in range(pp)
        for j in range(max(1, span // ep))
    }
    return tuple(sorted(seen))


def block_crosses(world: int, pp: int, domain: int) -> bool:
    """True when some PP rank's block of ``world / pp`` ranks (its DP and expert-DP groups) spans two
    NVLink domains."""
    span = world // pp
    return any(len(pieces(p * span, span, domain)) > 1 for p in range(pp))


def pp_hop_crosses(world: int, pp: int, domain: int) -> bool:
    """True when some PP send (rank ``r`` to ``r + world / pp``) leaves its NVLink domain: with more than
    one PP rank, whenever the ranks fill more than one domain (the stage at a domain's end sends to the
    next; the pipeline is priced at its slowest hop)."""
    return pp > 1 and world > domain
