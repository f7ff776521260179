"""Decoder layers per pipeline stage: megatron-core 0.19.2's three ways of placing them (an even split,
``num_layers_in_first/last_pipeline_stage``, a ``pipeline_model_parallel_layout`` string) and a
cost-balanced layout string for the planner's search. Pure Python; every error names the setting.
"""

from __future__ import annotations

from k2.config.errors import ConfigError

# Layout-string syntax accepted by megatron-core 0.19.2's PipelineParallelLayerLayout.parse_str_to_list.
LAYOUT_SYNTAX = (
    "E = embedding, t = decoder layer, L = loss, '|' separates virtual stages (order vpp_stage*pp + "
    "pp_rank), '(...)*n' and 'x*n' repeat, ',' is cosmetic; e.g. 'Et|(tt|)*30L'"
)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def format_values(values: list[int], limit: int = 24) -> str:
    if len(values) > limit:
        return ", ".join(str(v) for v in values[:limit]) + ", ..."
    return ", ".join(str(v) for v in values) if values else "none"


def counts_even(num_layers: int, pp: int, vpp: int) -> list[list[int]]:
    """Megatron's default split: num_layers / (pp * vpp) layers per virtual stage."""
    stages = pp * vpp
    if num_layers % stages != 0:
        per = (
            f"parallel.pp={pp} x parallel.vpp={vpp} = {stages} virtual stages"
            if vpp > 1
            else f"parallel.pp={pp} pipeline stages"
        )
        raise ConfigError(
            f"model.num_layers={num_layers} does not divide over {per} "
            f"({num_layers} layers for {stages} stages leaves {num_layers % stages} over); pp x vpp "
            f"must divide {num_layers} (allowed: {format_values(divisors(num_layers))}), or place the layers "
            "with parallel.layout (e.g. 'Et|(tt|)*30L') or parallel.first_stage_layers/last_stage_layers"
        )
    per_stage = num_layers // stages
    return [[per_stage] * vpp for _ in range(pp)]


def counts_uneven(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[list[int]]:
    """megatron ``num_layers_in_first/last_pipeline_stage``: the count for PP rank 0 (pp-1) is split
    evenly over that rank's vpp virtual stages; the rest goes evenly to the middle PP ranks."""
    given = " and ".join(
        f"parallel.{name}={value}"
        for name, value in (("first_stage_layers", first), ("last_stage_layers", last))
        if value is not None
    )
    if pp < 2:
        raise ConfigError(
            f"{given} needs parallel.pp >= 2 (with pp=1 the only rank is both first and last); "
            "set first_stage_layers and last_stage_layers to null"
        )
    for name, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        if value is not None and value % vpp != 0:
            raise ConfigError(
                f"parallel.{name}={value} is not divisible by parallel.vpp={vpp}: it counts the layers "
                f"of a whole PP rank, split evenly over its {vpp} virtual stages; allowed: multiples "
                f"of {vpp}, or use parallel.layout for an uneven split inside a rank"
            )
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_ranks = pp - (first is not None) - (last is not None)
    if middle_ranks == 0:
        if middle_layers != 0:
            raise ConfigError(
                f"{given} must add up to model.num_layers={num_layers} when parallel.pp={pp} leaves no "
                f"middle PP ranks (they sum to {(first or 0) + (last or 0)})"
            )
        if vpp > 1:
            chunks = ["t" * (first // vpp), "t" * (last // vpp)] * vpp  # order vpp_stage*pp + pp_rank
            chunks[0], chunks[-1] = "E" + chunks[0], chunks[-1] + "L"
            suggestion = "|".join(chunks)
            raise ConfigError(
                f"{given} with parallel.pp=2 and parallel.vpp={vpp} (no middle PP ranks) crash "
                "megatron-core 0.19.2 (ZeroDivisionError in get_transformer_layer_offset); use the "
                f"equivalent parallel.layout={suggestion!r} with first/last_stage_layers=null"
            )
    else:
        stages = middle_ranks * vpp
        if middle_layers <= 0 or middle_layers % stages != 0:
            left = f"leaves {middle_layers} layers" if middle_layers >= 0 else f"is {-middle_layers} short"
            raise ConfigError(
                f"model.num_layers={num_layers} minus {given} {left} for {middle_ranks} middle PP "
                f"ranks x parallel.vpp={vpp} = {stages} virtual stages"
                + (f" ({middle_layers % stages} left over)" if middle_layers > 0 else "")
                + f"; the middle layers must be a positive multiple of {stages}"
            )
    per_middle = middle_layers // (middle_ranks * vpp) if middle_ranks else 0
    counts = [[per_middle] * vpp for _ in range(pp)]
    if first is not None:
        counts[0] = [first // vpp] * vpp
    if last is not None:
        counts[pp - 1] = [last // vpp] * vpp
    return counts


def counts_from_layout(layout: str, pp: int, vpp: int, num_layers: int) -> list[list[int]]:
    """Parse ``layout`` with megatron-core's ``PipelineParallelLayerLayout`` and validate it the way
    ``TransformerConfig.__post_init__`` does (plus: E must open virtual stage 0, L close the last)."""
    if not isinstance(layout, str) or not layout.strip():
        raise ConfigError(f"parallel.layout={layout!r} must be a non-empty string ({LAYOUT_SYNTAX})")
    # Lazy: importing megatron-core costs seconds and is only needed for a custom layout. Its import
    # warns about the missing Transformer Engine/Apex, which is noise for a config check.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )

    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
    except Exception as e:  # megatron asserts on unknown characters; bad repeats surface the same way
        raise ConfigError(
            f"parallel.layout={layout!r} cannot be parsed by megatron-core: {e}; allowed syntax: {LAYOUT_SYNTAX}"
        ) from None
    n = len(stages)
    if n % pp != 0:
        raise ConfigError(
            f"parallel.layout={layout!r} has {n} virtual stages ('|'-separated), not a multiple of "
            f"parallel.pp={pp}; allowed: pp x vpp = {pp * vpp} stages for parallel.vpp={vpp}"
        )
    if n // pp != vpp:
        raise ConfigError(
            f"parallel.layout={layout!r} has {n} virtual stages = parallel.pp={pp} x {n // pp}, but "
            f"parallel.vpp={vpp}"
            + (" (null)" if vpp == 1 else "")
            + f"; set parallel.vpp={n // pp} or give a layout with {pp * vpp} stages"
        )
    try:
        parsed = PipelineParallelLayerLayout(layout, pp)
    except Exception as e:
        raise ConfigError(f"parallel.layout={layout!r} is rejected by megatron-core: {e}") from None
    flat = parsed.flatten_layout
    if LayerType.mtp in flat:
        raise ConfigError(
            f"parallel.layout={layout!r} contains MTP layers ('m'), which the K2 recipes do not build; "
            "allowed layer characters: E, t, L"
        )
    first_stage, last_stage = parsed.layout[0][0], parsed.layout[pp - 1][vpp - 1]
    if (
        flat.count(LayerType.embedding) != 1
        or flat.count(LayerType.loss) != 1
        or not first_stage
        or first_stage[0] != LayerType.embedding
        or not last_stage
        or last_stage[-1] != LayerType.loss
    ):
        raise ConfigError(
            f"parallel.layout={layout!r} must contain exactly one E, as the first character of the first "
            "virtual stage, and exactly one L, as the last character of the last virtual stage "
            f"(e.g. 'Et|(tt|)*30L'); got {flat.count(LayerType.embedding)} E and "
            f"{flat.count(LayerType.loss)} L"
        )
    n_t = flat.count(LayerType.decoder)
    if n_t != num_layers:
        raise ConfigError(
            f"parallel.layout={layout!r} places {n_t} decoder layers ('t') but model.num_layers="
            f"{num_layers}; the number of 't' must equal model.num_layers"
        )
    try:  # megatron's own final check (counts, MTP placement, encoder layers)
        parsed.validate_layer_layout(num_layers=num_layers, mtp_num_layers=None)
    except Exception as e:
        raise ConfigError(f"parallel.layout={layout!r} is rejected by megatron-core: {e}") from None
    return [[parsed.layout[r][v].count(LayerType.decoder) for v in range(vpp)] for r in range(pp)]


def balanced_layout(
    layer_costs: list[float], pp: int, vpp: int = 1, embedding_cost: float = 0.0, loss_cost: float = 0.0
) -> str:
    """A ``k2.parallel.layout`` string that spreads contiguous decoder layers over ``pp x vpp`` virtual stages
    so that the busiest PP rank (the sum of its ``vpp`` stages) is as cheap as possible (used by
    ``k2-plan plan.search=true``).

    In interleaved 1F1B every rank runs each of its stages once per microbatch, so the busiest rank sets
    the pace; within a rank the work is split evenly over its stages (rounded to whole layers). The
    embedding opens the first virtual stage and the loss (final norm + output head) closes the last, as
    megatron requires (module docstring); stages are written in pipeline order (``vpp_stage * pp +
    pp_rank``). For K2 on PP16 x VPP2 (LM head about two layers) rank 15 gets one layer besides the loss
    and every other rank four: ``Et|tt|...|t|tt|...|t|L``-like, where the recipe's ``Et|(tt|)*30L`` gives
    rank 15 two layers + the loss.

    Args:
        layer_costs: cost of each decoder layer (any unit, e.g. training FLOPs per token).
        pp, vpp: pipeline and virtual-pipeline sizes.
        embedding_cost, loss_cost: cost of the embedding / of the loss stage's head.

    Raises:
        ValueError: ``pp`` or ``vpp`` < 1, or a negative cost.
    """
    if pp < 1 or vpp < 1 or any(c < 0 for c in layer_costs) or embedding_cost < 0 or loss_cost < 0:
        raise ValueError("balanced_layout needs pp, vpp >= 1 and non-negative costs")
    n, S = len(layer_costs), pp * vpp

    def place(cap: float, spread: bool = False) -> list[int] | None:
        """Layers per stage when no rank carries more than ``cap``: each stage of rank r takes layers, in
        pipeline order, up to about ``(cap - fixed_r) / vpp`` (a layer goes in if at least half of it
        fits there and all of it fits in the rank's ``cap``); ``spread``: also no more than its share of the
        layers left, by its budget among the budgets of the stages left, so that the last stages are not
        left empty. None if layers are left over."""
        counts, i = [0] * S, 0
        fixed = [(embedding_cost if r == 0 else 0.0) + (loss_cost if r == pp - 1 else 0.0) for r in range(pp)]
        budgets = [(cap - fixed[g % pp]) / vpp for g in range(S)]
        rank_load = list(fixed)
        for g in range(S):
            r = g % pp
            budget = budgets[g]
            if spread and budget > 0:
                budget = min(budget, sum(layer_costs[i:]) * budget / sum(b for b in budgets[g:] if b > 0))
            load = 0.0
            while i < n and load + layer_costs[i] / 2 <= budget and rank_load[r] + layer_costs[i] <= cap:
                load += layer_costs[i]
                rank_load[r] += layer_costs[i]
                counts[g] += 1
                i += 1
        return counts if i == n else None

    lo, hi = 0.0, embedding_cost + loss_cost + 2 * sum(layer_costs) + 1.0
    for _ in range(100):  # bisection on the busiest rank's load
        mid = (lo + hi) / 2
        if place(mid) is None:
            lo = mid
        else:
            hi = mid
    counts = place(hi)
    assert counts is not None
    if any(not any(counts[v * pp + r] for v in range(vpp)) for r in range(pp - 1)):
        # a rank left with no layer (and no loss: not the last): the same busiest rank with the layers
        # spread, where that places them all (K2's 61 layers over 25 ranks: 3, 2, 3, 2, ... not 3 x 20, 0 x 4)
        counts = place(hi, spread=True) or counts
    stages = ["t" * c for c in counts]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages)
