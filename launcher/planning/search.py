"""``plan.search=true``: every valid layout (PP, VPP, EP; with ``parallel.tp`` > 1 also that TP) of a cluster
with a cost-balanced layer layout, ranked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.launcher.planning.analysis import analyse_layout
from k2.model.flops import flops_per_token
from k2.parallel.dims import ParallelDims
from k2.parallel.layout import balanced_layout
from k2.schedules.resolve import resolve_schedule

if TYPE_CHECKING:
    from k2.config.schema import K2Config

#: how k2-plan names its world size in error messages
WORLD_FROM = "cluster.nodes x cluster.gpus_per_node"
_SEARCH_VPP = (1, 2, 3, 4)  # virtual stages per PP rank tried by plan.search
_SEARCH_MICROBATCHES = 4  # plan.search simulates min(m, 4 pp) microbatches and extrapolates (docstring)


def _tp_pp_vpp(world: int, tp: int, num_layers: int):
    """The (TP, PP, VPP) sizes the search tries: TP 1 and ``parallel.tp`` where that is more (a TP layout
    k2-train cannot run: the rows say so), every PP dividing ``world / tp``, VPP 1-4 where PP > 1 and the
    stages do not outnumber the layers (+ 1: a loss-only stage)."""
    for t in sorted({1, tp}):
        if world % t:
            continue
        for pp in [d for d in range(1, world // t + 1) if (world // t) % d == 0]:
            for vpp in _SEARCH_VPP:
                if not ((vpp > 1 and pp < 2) or pp * vpp > num_layers + 1):
                    yield t, pp, vpp


def _idle_rank(layout: str, pp: int, vpp: int) -> bool:
    """True when some PP rank of ``layout`` (explicit stages, pipeline order ``v * pp + rank``, as
    :func:`k2.parallel.layout.balanced_layout` writes them) holds no layer, embedding or loss in any of its
    virtual stages."""
    stages = layout.split("|")
    return any(all(not stages[v * pp + r] for v in range(vpp)) for r in range(pp))


def layout_candidates(cfg: K2Config, world: int, counts, *, stop_at_fit: bool = False):
    """Every valid layout (tp, pp, vpp, ep) of ``world`` GPUs with a cost-balanced layer layout
    (:func:`k2.parallel.layout.balanced_layout`), analysed (:func:`k2.launcher.planning.analysis.analyse_layout`,
    the search's extrapolation and pruning): yields ``(parallel settings, analysis)``; a layout the schedule
    cannot run (e.g. the batch does not split into whole microbatches) is skipped. ``stop_at_fit``: stop after
    the first that fits (the most model-parallel first, the likeliest to fit)."""
    from omegaconf import OmegaConf, read_write

    L = int(cfg.model.num_layers)
    experts = int(cfg.model.num_moe_experts or 0)
    cache = {}
    base = OmegaConf.to_container(cfg, resolve=True)
    fl = flops_per_token(cfg.model, resolve_schedule(cfg).phases[0].seq_length)
    layer_costs = [fl.layer(i) for i in range(L)]
    shapes = []
    for tp, pp, vpp in _tp_pp_vpp(world, int(cfg.parallel.tp or 1), L):
        span = world // pp  # the TP x DP ranks of a PP stage, which EP spans (expert TP 1)
        shapes += [
            (tp, pp, vpp, ep)
            for ep in range(1, span + 1)
            if span % ep == 0 and (experts % ep == 0 if experts else ep == 1)
        ]
    if stop_at_fit:
        shapes.sort(key=lambda s: (-s[1] * max(s[0], s[3]), s[2]))
    # one copy of the config, its parallel section replaced per layout: a copy per layout (OmegaConf.merge
    # deep-copies every node) cost more than analysing the layout; nothing yielded reads its parallel section
    c = OmegaConf.merge(cfg, {})
    layouts: dict = {}  # (pp, vpp) -> the balanced layer layout: the same for every TP and EP
    for tp, pp, vpp, ep in shapes:
        if (pp, vpp) not in layouts:
            layouts[pp, vpp] = balanced_layout(layer_costs, pp, vpp, 0.0, fl.lm_head)
        if _idle_rank(layouts[pp, vpp], pp, vpp):
            continue  # a PP rank with nothing to run: GPUs that wait for the others
        par = dict(
            base["parallel"],
            tp=tp,
            pp=pp,
            vpp=vpp if vpp > 1 else None,
            ep=ep,
            layout=layouts[pp, vpp],
            first_stage_layers=None,
            last_stage_layers=None,
        )
        with read_write(c):
            c.parallel.merge_with(par)
        try:
            dims = ParallelDims.from_config(c.parallel, c.model, world, world_size_from=WORLD_FROM, tp_supported=True)
            schedule = resolve_schedule(c, dims)
        except ConfigError:
            continue
        a = analyse_layout(
            c, dims, counts, schedule, max_microbatches=_SEARCH_MICROBATCHES * pp, cache=cache, prune=True
        )
        yield (par, dims), a
        if stop_at_fit and a["fits"]:
            return


def search_layouts(cfg: K2Config, world: int, counts) -> list[dict[str, Any]]:
    """``plan.search=true``: every valid layout (:func:`layout_candidates`): the layouts that fit in memory
    first, each group ranked by the step-time model's estimate (:mod:`k2.launcher.planning.step_time`: an EP
    group that crosses nodes pays its all-to-all) (``fits`` marks them)."""
    rows = []
    for (par, dims), a in layout_candidates(cfg, world, counts):
        rows.append(
            {
                "tp": par["tp"],
                "pp": par["pp"],
                "vpp": par["vpp"] or 1,
                "ep": par["ep"],
                "dp": dims.dp,
                "layout": par["layout"],
                "k2_train_runs": par["tp"] == 1,  # (k2-train runs TP 1 only; k2-plan plans megatron's TP layout)
                "num_microbatches": a["main"]["num_microbatches"],
                "bubble_fraction": a["main"]["bubble"],
                "step_time_s_estimated": a["main"]["makespan"],
                "ep_overlap": a["main"]["ep_overlap"],
                "ep_overlap_note": a["main"]["ep_overlap_note"],
                "memory_per_gpu_bytes": a["worst_gpu"].total,
                "memory_lower_bound": a["memory_lower_bound"],
                "fits": a["fits"],
            }
        )
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s_estimated"], r["memory_per_gpu_bytes"]))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return rows
