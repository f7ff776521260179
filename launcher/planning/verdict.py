"""``plan.search=true``'s verdict: the layout k2-plan recommends for the cluster, whether anything fits, and
what to change when nothing does or when the GPU is larger than the memory settings assume.

* **The recommended layout** is the search's first row (:func:`k2.launcher.planning.search.search_layouts`:
  those that fit first, each group by the estimated step); when none fits, the layout needing the least
  memory per GPU (of those whose memory is computed, not bounded below). With ``plan.search`` the plan printed below the
  verdict is of that layout, not of ``parallel.*`` (which may not even divide the cluster).
* **When nothing fits**, the smallest node count that does: the cluster's node count times 2, 4, ... 64
  until one fits (each count searched the same way; its layouts tried until one fits), then every node
  count between that and the last that did not, from the lowest up (bisection first where they are more
  than :data:`_SCAN` apart); None when nothing fits up to 64 times the cluster.
* **Memory settings a larger GPU does not need**: for the recommended layout, each group of ``memory.*``
  (``offload``, ``recompute``, ``fp8_store``; a schedule phase's own settings are kept) and
  ``optim.offload_fraction`` set to nothing, one at a time; those with which every phase still fits are
  listed with the step they give (a recipe sized for 80 GB spends step time on memory a 180 GB GPU has),
  and those of them that, dropped together, shorten the step most (:func:`faster_memory_settings`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from omegaconf import OmegaConf

from k2.launcher.planning.analysis import analyse_layout
from k2.launcher.planning.search import WORLD_FROM, _tp_pp_vpp, layout_candidates, search_layouts
from k2.parallel.dims import ParallelDims
from k2.schedules.resolve import resolve_schedule

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = [
    "faster_memory_settings",
    "layout_settings",
    "search_verdict",
    "smallest_fitting_world",
    "with_global_batch",
    "unneeded_memory_settings",
]

#: node-count multiples tried for the smallest GPU count that fits (each is a search of its own)
_GROW = (2, 4, 8, 16, 32, 64)
#: node counts scanned one by one (below the first multiple that fits); a wider stretch is bisected first
_SCAN = 32
#: the memory settings a larger GPU may not need, each with its "off" value
_MEMORY_SETTINGS: tuple[tuple[str, Any], ...] = (
    ("memory.offload", []),
    ("optim.offload_fraction", 0.0),
    ("memory.recompute", []),
    ("memory.fp8_store", []),
)


def layout_settings(row: dict[str, Any]) -> dict[str, Any]:
    """The ``parallel.*`` values of one search row (what ``k2-plan`` / ``k2-train`` take)."""
    return {
        "tp": row.get("tp", 1),
        "pp": row["pp"],
        "vpp": row["vpp"] if row["vpp"] > 1 else None,
        "ep": row["ep"],
        "layout": row["layout"],
        "first_stage_layers": None,
        "last_stage_layers": None,
    }


def with_layout(cfg: K2Config, row: dict[str, Any]) -> K2Config:
    """``cfg`` with the row's layout as its ``parallel.*``."""
    return _merge(cfg, {"parallel": {**layout_settings(row), "name": "search"}})


def with_global_batch(cfg: K2Config, tokens: int) -> K2Config:
    """``cfg`` with ``schedule.global_batch_tokens`` set to ``tokens``."""
    return _merge(cfg, {"schedule": {"global_batch_tokens": int(tokens)}})


def _merge(cfg: K2Config, *others: Any) -> K2Config:
    """``OmegaConf.merge`` typed as the schema it keeps (a structured config merged stays one)."""
    return cast("K2Config", OmegaConf.merge(cfg, *others))


def _select(cfg: K2Config, key: str) -> Any:
    """``OmegaConf.select`` on the typed config (at run time a ``DictConfig``)."""
    return OmegaConf.select(cast(Any, cfg), key)


def _fits(cfg: K2Config, world: int, counts) -> tuple[bool, float]:
    """Whether ``cfg``'s layout fits every phase on ``world`` GPUs, and its main phase's step (seconds)."""
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world, world_size_from=WORLD_FROM, tp_supported=True)
    a = analyse_layout(cfg, dims, counts, resolve_schedule(cfg, dims))
    return bool(a["fits"]), float(a["main"]["makespan"])


def unneeded_memory_settings(cfg: K2Config, world: int, counts) -> list[dict[str, Any]]:
    """The memory settings (module docstring) ``cfg``'s layout still fits without, one at a time: ``{"setting",
    "was", "off", "step_time_s"}`` (``off``: the override that drops it; the main phase's step without it)."""
    out = []
    for key, off in _MEMORY_SETTINGS:
        was = _select(cfg, key)
        if not was:
            continue
        variant = _merge(cfg, OmegaConf.from_dotlist([f"{key}={off}"]))
        fits, step = _fits(variant, world, counts)
        if fits:
            out.append(
                {
                    "setting": key,
                    "was": OmegaConf.to_container(was) if not isinstance(was, float) else was,
                    "off": f"{key}={off}",
                    "step_time_s": step,
                }
            )
    return out


def faster_memory_settings(
    cfg: K2Config, world: int, counts, step_s: float, unneeded: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The unneeded memory settings that, dropped together, shorten the step most: greedily, the drop that
    shortens it most first (from ``unneeded``, each dropped alone), then each remaining one tried on top of
    those already dropped, while every phase fits and the step gets shorter. One at a time can mislead:
    with ``memory.offload`` kept, dropping ``memory.recompute`` offloads what recompute used to drop, and the
    step lengthens, though without offload it would shorten. ``{"overrides", "step_time_s"}`` or None when
    no drop shortens the step."""
    shorter = 1 - 1e-3  # a drop counts when it saves at least 0.1% of the step
    tried = {u["off"]: u["step_time_s"] for u in unneeded}
    chosen: list[str] = []
    while tried:
        off, step = min(tried.items(), key=lambda kv: kv[1])
        if step >= step_s * shorter:
            break
        chosen.append(off)
        cfg, step_s = _merge(cfg, OmegaConf.from_dotlist([off])), step
        # the rest, each on top of those dropped (a dropped setting is off, so it is not tried again)
        tried = {u["off"]: u["step_time_s"] for u in unneeded_memory_settings(cfg, world, counts)}
    return {"overrides": chosen, "step_time_s": step_s} if chosen else None


def smallest_fitting_world(cfg: K2Config, counts) -> tuple[int | None, str]:
    """The smallest GPU count on which some layout fits, above ``cluster.nodes`` (on which none does; module
    docstring), and how it was searched, in words; ``(None, ...)`` when none fits up to 64 times the
    cluster's nodes."""
    gpn, nodes = int(cfg.cluster.gpus_per_node), int(cfg.cluster.nodes)

    def fits(n: int) -> bool:
        grown = _merge(cfg, {"cluster": {"nodes": n, "segment_nodes": None}})
        return any(a["fits"] for _, a in layout_candidates(grown, n * gpn, counts, stop_at_fit=True))

    lo, hi = nodes, None
    for k in _GROW:
        if fits(nodes * k):
            hi = nodes * k
            break
        lo = nodes * k
    if hi is None:
        return None, f"tried {nodes} x 2, 4, ... 64 nodes"
    how = f"every node count from {lo + 1} up"
    if hi - lo > _SCAN:
        how = f"bisection between {lo} and {hi} nodes, then every node count up"
    while hi - lo > _SCAN:  # (fitting is nearly monotone in the GPU count: more GPUs, less memory each)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    first = next((n for n in range(lo + 1, hi) if fits(n)), hi)
    return first * gpn, how


def rounded_global_batch(cfg: K2Config, world: int) -> int:
    """The ``schedule.global_batch_tokens`` nearest to ``cfg``'s that some (TP, PP, VPP) shape of ``world``
    GPUs can run in every phase: a multiple of every phase's ``seq_length`` and, for each phase that runs a
    step, of its ``seq_length x micro_batch_size x dp``, times
    ``pp`` with virtual stages (megatron's interleaved 1F1B runs whole groups of ``pp`` microbatches:
    :func:`k2.parallel.dims.check_microbatches`); the smaller of two equally near."""
    from math import lcm

    G = int(cfg.schedule.global_batch_tokens)
    phases = resolve_schedule(cfg).phases
    whole = lcm(*(p.seq_length for p in phases))  # every phase's batch a whole number of sequences
    best = None
    for tp, pp, vpp in _tp_pp_vpp(world, int(cfg.parallel.tp or 1), int(cfg.model.num_layers)):
        dp = world // (tp * pp)
        unit = lcm(whole, *(p.seq_length * p.micro_batch_size * dp * (pp if vpp > 1 else 1) for p in phases if p.steps))
        g = max(unit, round(G / unit) * unit)
        if best is None or (abs(g - G), g) < (abs(best - G), best):
            best = g
    return G if best is None else best


def search_verdict(cfg: K2Config, world: int, counts) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The search's rows and its verdict: ``fits``, ``recommended`` (the first row, or None when no layout can
    run the schedule), ``smallest_fitting_gpus`` (when nothing fits), ``unneeded_memory_settings`` (when the
    recommended layout fits; ``memory_settings_set``: those it tried) and ``global_batch_rounded`` (``{"from",
    "to"}`` tokens, when no layout runs the configured global batch and the search ran on the nearest one
    that some layout does, :func:`rounded_global_batch`; else None)."""
    rows = search_layouts(cfg, world, counts)
    rounded = None
    if not rows:
        G, g = int(cfg.schedule.global_batch_tokens), rounded_global_batch(cfg, world)
        if g != G:
            cfg = with_global_batch(cfg, g)
            rows, rounded = search_layouts(cfg, world, counts), {"from": G, "to": g}
    best = rows[0] if rows else None
    if best is not None and not best["fits"]:  # nothing fits: the layout nearest to fitting
        best = min(rows, key=lambda r: (r["memory_lower_bound"], r["memory_per_gpu_bytes"], r["step_time_s_estimated"]))
    verdict: dict[str, Any] = {
        "fits": bool(best and best["fits"]),
        "recommended": best,
        "smallest_fitting_gpus": None,
        "smallest_fitting_searched": None,
        "memory_settings_set": [],
        "unneeded_memory_settings": [],
        "faster_memory_settings": None,
        "global_batch_rounded": rounded,
    }
    if best is None or not best["fits"]:
        verdict["smallest_fitting_gpus"], verdict["smallest_fitting_searched"] = smallest_fitting_world(cfg, counts)
    else:
        verdict["memory_settings_set"] = [k for k, _ in _MEMORY_SETTINGS if _select(cfg, k)]
        chosen = with_layout(cfg, best)
        verdict["unneeded_memory_settings"] = unneeded = unneeded_memory_settings(chosen, world, counts)
        step = _fits(chosen, world, counts)[1]  # as each drop's step is computed (the search may extrapolate)
        verdict["faster_memory_settings"] = faster_memory_settings(chosen, world, counts, step, unneeded)
    return rows, verdict
