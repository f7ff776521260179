"""Tests for :mod:`k2.parallel.dims` (no process groups).

The independent reference for the layer table is megatron-core 0.19.2 itself: a real
``TransformerConfig`` built from ``ParallelDims.megatron_kwargs()`` is handed to megatron's
``get_transformer_layer_offset`` and ``get_num_layers_to_build`` for every (pp_rank, vpp_stage), with the
``megatron.core.parallel_state`` getters monkeypatched to report that rank instead of initialising
process groups.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.config.schema import ModelConfig, ParallelConfig
from k2.parallel.dims import ParallelDims, check_microbatches

# megatron-core's TransformerConfig warns about its defaults and about running without a rank; noise here
pytestmark = [
    pytest.mark.filterwarnings("ignore:full scope is deprecated"),
    pytest.mark.filterwarnings("ignore:Could not determine rank"),
]

# ---------------------------------------------------------------------------- helpers


def _par(**kw) -> ParallelConfig:
    return dataclasses.replace(ParallelConfig(), **kw)


def _model(num_layers: int = 4, num_moe_experts: int | None = 8) -> ModelConfig:
    return dataclasses.replace(ModelConfig(), num_layers=num_layers, num_moe_experts=num_moe_experts)


def _dims(world_size: int, num_layers: int = 4, num_moe_experts: int | None = 8, **par) -> ParallelDims:
    return ParallelDims.from_config(_par(**par), _model(num_layers, num_moe_experts), world_size)


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's layer-placement functions (imported once; the import takes seconds)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from megatron.core import parallel_state
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    return dict(
        torch=torch,
        ps=parallel_state,
        TransformerConfig=TransformerConfig,
        get_num_layers_to_build=get_num_layers_to_build,
        get_transformer_layer_offset=get_transformer_layer_offset,
    )


def _megatron_config(megatron, dims: ParallelDims):
    kw = {k: v for k, v in dims.megatron_kwargs().items() if k.startswith(("pipeline_", "virtual_", "num_layers_in_"))}
    return megatron["TransformerConfig"](
        num_layers=dims.num_layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_dtype=megatron["torch"].float32,
        **kw,
    )


def megatron_table(megatron, monkeypatch, dims: ParallelDims) -> list[list[list[int]]]:
    """``[pp_rank][vpp_stage] -> layer ids`` as megatron-core computes them for this config."""
    cfg = _megatron_config(megatron, dims)
    ps = megatron["ps"]
    vp_size = dims.megatron_vpp
    table = []
    for r in range(dims.pp):
        row = []
        for v in range(dims.vpp):
            monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda *a, _r=r, **k: _r)
            monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda *a, **k: dims.pp)
            monkeypatch.setattr(ps, "get_virtual_pipeline_model_parallel_rank", lambda *a, _v=v, **k: _v)
            monkeypatch.setattr(ps, "get_virtual_pipeline_model_parallel_world_size", lambda *a, **k: vp_size)
            vp_stage = v if vp_size is not None else None
            offset = megatron["get_transformer_layer_offset"](cfg, vp_stage=vp_stage, pp_rank=r)
            count = megatron["get_num_layers_to_build"](cfg, vp_stage=vp_stage, pp_rank=r)
            row.append(list(range(offset, offset + count)))
        table.append(row)
    return table


def _all_layers(dims: ParallelDims) -> list[int]:
    return sorted(i for row in dims.stage_layers for stage in row for i in stage)


# ---------------------------------------------------------------------------- recipes

# recipe -> (overrides, world size, expected table, dp)
RECIPES = {
    "single": (["parallel=single"], 1, [[[0, 1, 2, 3]]], 1),
    "pp2": (["parallel=pp2"], 2, [[[0, 1]], [[2, 3]]], 1),
    "cpu4": (["parallel=cpu4"], 4, [[[0], [2]], [[1], [3]]], 2),
    # 32 nodes x 8 GPUs (the recipe's cluster block; the world size is passed explicitly here)
    "k2_256gpu": (["model=kimi_k2", "parallel=k2_256gpu"], 256, None, 16),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe(recipe, megatron, monkeypatch):
    overrides, world_size, expected, dp = RECIPES[recipe]
    cfg = load_config(overrides)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world_size)

    assert cfg.parallel.name == recipe
    assert (dims.tp, dims.pp, dims.ep, dims.dp) == (
        cfg.parallel.tp,
        cfg.parallel.pp,
        cfg.parallel.ep,
        dp,
    )
    assert dims.vpp == (cfg.parallel.vpp or 1)
    assert dims.megatron_layout == cfg.parallel.layout
    if expected is not None:
        assert dims.stage_layers == expected
    assert _all_layers(dims) == list(range(cfg.model.num_layers))
    assert dims.stage_layers == megatron_table(megatron, monkeypatch, dims)
    assert dims.stage_has_embedding(0, 0) and dims.stage_has_loss(dims.pp - 1, dims.vpp - 1)
    if recipe != "k2_256gpu":  # the local recipes run k2_tiny's schedule in every phase (K2's: test_k2_layout)
        from k2.schedules.resolve import resolve_schedule

        assert all(p.num_microbatches >= 1 for p in resolve_schedule(cfg, dims).phases if p.steps)


def test_k2_layout(megatron, monkeypatch):
    """K2: 61 layers over PP16 x VPP2 with 'Et|(tt|)*30L' (docs/k2_reference.md, "Training system")."""
    cfg = load_config(["model=kimi_k2", "parallel=k2_256gpu"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 256)
    assert (dims.pp, dims.vpp, dims.ep, dims.dp, dims.expert_dp) == (16, 2, 16, 16, 1)
    assert dims.num_layers == 61 and _all_layers(dims) == list(range(61))
    # first virtual stage: embedding + layer 0; last: the loss alone
    assert dims.stage_layers[0][0] == [0]
    assert dims.stage_has_embedding(0, 0)
    assert not dims.stage_has_loss(0, 0)
    assert dims.stage_layers[15][1] == []
    assert dims.stage_has_loss(15, 1) and not dims.stage_has_embedding(15, 1)
    # every other virtual stage holds two consecutive layers, in order vpp_stage * pp + pp_rank
    assert dims.stage_layers[1][0] == [1, 2] and dims.stage_layers[15][0] == [29, 30]
    assert dims.stage_layers[0][1] == [31, 32] and dims.stage_layers[14][1] == [59, 60]
    assert dims.virtual_stage(0, 1) == 16
    assert sum(1 for r in range(16) for v in range(2) if dims.stage_has_embedding(r, v)) == 1
    assert sum(1 for r in range(16) for v in range(2) if dims.stage_has_loss(r, v)) == 1
    assert dims.stage_layers == megatron_table(megatron, monkeypatch, dims)
    # K2's batch: 16,384 sequences, mbs 1, dp 16 -> 1024 microbatches (a multiple of pp=16)
    assert check_microbatches(dims, 16384, 1) == 1024
    # the plan-side world size of k2_256gpu, any multiple of 32 nodes reuses the group
    assert ParallelDims.from_config(cfg.parallel, cfg.model, 512).dp == 32


# ---------------------------------------------------------------------------- megatron cross-checks

# (world_size, num_layers, parallel settings)
MEGATRON_CASES = [
    (1, 4, dict(pp=1)),
    (8, 16, dict(pp=4, vpp=2, ep=2)),
    (4, 12, dict(pp=2, vpp=3)),
    (8, 8, dict(pp=8)),
    (4, 10, dict(pp=4, first_stage_layers=1, last_stage_layers=3)),
    (4, 12, dict(pp=4, vpp=2, first_stage_layers=2, last_stage_layers=2)),
    (3, 10, dict(pp=3, vpp=2, last_stage_layers=2)),
    (3, 12, dict(pp=3, vpp=2, first_stage_layers=4)),
    (2, 8, dict(pp=2, vpp=2, first_stage_layers=4)),
    (4, 5, dict(pp=2, first_stage_layers=2, last_stage_layers=3)),
    (16, 61, dict(pp=16, first_stage_layers=1)),
    (32, 61, dict(pp=16, last_stage_layers=1)),
    (1, 4, dict(pp=1, layout="EttttL")),
    (2, 4, dict(pp=2, layout="Ettt|tL")),
    (4, 4, dict(pp=2, vpp=2, layout="E|tt|tt|L")),
    (4, 5, dict(pp=4, layout="Et,t|tt||tL")),
    (6, 7, dict(pp=3, vpp=2, layout="Et|t|tt|t|t*2|L")),
]


@pytest.mark.parametrize("world_size,num_layers,par", MEGATRON_CASES, ids=lambda x: str(x))
def test_table_matches_megatron(world_size, num_layers, par, megatron, monkeypatch):
    dims = _dims(world_size, num_layers, **par)
    assert _all_layers(dims) == list(range(num_layers))
    assert dims.stage_layers == megatron_table(megatron, monkeypatch, dims)


# K2's 61 layers over PP16 (docs/k2_reference.md "Training system"): VPP 1 with first/last-stage overrides, VPP 2
# and VPP 4 with layout strings (61 layers cannot be split by overrides when vpp > 1: first/last must be
# multiples of vpp, which leaves an odd number for an even count of middle stages).
K2_VPP4 = "Et|" + "t|" * 46 + "|" + "t|" * 14 + "|L"
K2_LAYOUTS = [
    dict(pp=16, first_stage_layers=1),
    dict(pp=16, last_stage_layers=1),
    dict(pp=16, first_stage_layers=3, last_stage_layers=2),
    dict(pp=16, first_stage_layers=5, last_stage_layers=4),  # 52 / 14 does not divide -> error below
    dict(pp=16, vpp=2, layout="Et|(tt|)*30L"),
    dict(pp=16, vpp=2, layout="Ett|" + "tt|" * 14 + "t|" + "tt|" * 15 + "L"),
    dict(pp=16, vpp=4, layout=K2_VPP4),
]


@pytest.mark.parametrize("par", K2_LAYOUTS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_k2_61_layers_over_pp16(par, megatron, monkeypatch):
    if par.get("first_stage_layers") == 5:
        with pytest.raises(ConfigError, match="middle layers must be a positive multiple of 14"):
            _dims(256, 61, 384, ep=16, **par)
        return
    dims = _dims(256, 61, 384, ep=16, **par)
    in_pipeline_order = [i for v in range(dims.vpp) for r in range(dims.pp) for i in dims.stage_layers[r][v]]
    assert in_pipeline_order == list(range(61))  # every layer exactly once, in order
    assert dims.stage_layers == megatron_table(megatron, monkeypatch, dims)
    if "first_stage_layers" in par:
        assert len(dims.stage_layers[0][0]) == par["first_stage_layers"]
    if "last_stage_layers" in par:
        assert len(dims.stage_layers[15][0]) == par["last_stage_layers"]


@pytest.mark.parametrize("vpp", [2, 4])
def test_k2_61_layers_no_overrides_with_vpp(vpp):
    with pytest.raises(ConfigError, match="parallel.vpp"):
        _dims(256, 61, 384, ep=16, pp=16, vpp=vpp, first_stage_layers=vpp)


def test_balanced_layout(megatron, monkeypatch):
    """k2-plan's search places layers by cost; the strings are valid megatron layouts for any pp x vpp,
    and the busiest rank carries the least possible whole-layer load for equal layers."""
    from k2.parallel.layout import balanced_layout

    assert balanced_layout([1.0] * 61, 16, 4, 0.0, 2.2) == K2_VPP4
    for pp, vpp in [(16, 1), (16, 2), (16, 4), (8, 3), (4, 2), (1, 1), (2, 1)]:
        layout = balanced_layout([1.0] * 61, pp, vpp, 0.0, 2.2)
        dims = _dims(pp * 16, 61, 384, ep=16, pp=pp, vpp=vpp if vpp > 1 else None, layout=layout)
        assert dims.stage_layers == megatron_table(megatron, monkeypatch, dims)
        loads = [sum(len(dims.stage_layers[r][v]) for v in range(vpp)) + (2.2 if r == pp - 1 else 0) for r in range(pp)]
        assert max(loads) <= -(-(61 + 2.2) // pp) + 0.2 + 1e-9, (pp, vpp, loads)
    with pytest.raises(ValueError):
        balanced_layout([1.0], 0)


def test_balanced_layout_leaves_no_rank_without_layers():
    """61 layers over 25 PP ranks: the busiest rank needs 3 layers; filling ranks to 3 in order left the
    last four before the loss with none (idle GPUs). The layers are spread, 3 and 2, with the same busiest
    rank; k2-plan's search skips any layout that still leaves a rank idle."""
    from k2.launcher.planning.search import _idle_rank
    from k2.parallel.layout import balanced_layout

    layout = balanced_layout([1.0] * 61, 25, 1, 0.0, 2.0)
    stages = layout.split("|")
    assert all(stages) and max(s.count("t") + 2 * s.count("L") for s in stages) == 3
    assert sum(s.count("t") for s in stages) == 61
    assert _idle_rank("Et|t||L", 4, 1) and not _idle_rank(layout, 25, 1)
    assert not _idle_rank("Et|t||t|t|tL", 3, 2)  # (rank 2's first virtual stage is empty, its second is not)


def test_megatron_crashes_on_pp2_vpp_first_and_last(megatron, monkeypatch):
    """Why ParallelDims rejects first+last_stage_layers with pp=2, vpp>1: megatron-core 0.19.2 divides
    by the number of middle PP ranks (0). If this starts passing, megatron fixed it."""
    fake = dataclasses.replace(
        _dims(2, 8, pp=2, vpp=2, first_stage_layers=4), first_stage_layers=4, last_stage_layers=4
    )
    with pytest.raises(ZeroDivisionError):
        megatron_table(megatron, monkeypatch, fake)
    with pytest.raises(ConfigError) as e:
        _dims(2, 8, pp=2, vpp=2, first_stage_layers=4, last_stage_layers=4)
    msg = str(e.value)
    assert "parallel.first_stage_layers" in msg and "ZeroDivisionError" in msg
    suggestion = msg.split("parallel.layout='")[1].split("'")[0]
    assert suggestion == "Ett|tt|tt|ttL"
    dims = _dims(2, 8, pp=2, vpp=2, layout=suggestion)
    assert dims.stage_layers == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert dims.stage_layers == megatron_table(megatron, monkeypatch, dims)


def test_megatron_kwargs_and_queries():
    dims = _dims(4, pp=2, vpp=2, ep=2)
    assert dims.megatron_kwargs() == {
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": 2,
        "expert_model_parallel_size": 2,
        "pipeline_model_parallel_layout": None,
        "num_layers_in_first_pipeline_stage": None,
        "num_layers_in_last_pipeline_stage": None,
    }
    assert _dims(1).megatron_vpp is None and _dims(1).vpp == 1
    assert dims.num_virtual_stages == 4 and dims.layers(1, 1) == [3]
    assert "pp0: v0: E 0 | v1: 2" in dims.describe()
    with pytest.raises(IndexError):
        dims.stage_has_loss(2, 0)


def test_checkpoint_layout():
    """The layout a checkpoint records and a resume compares: one dict, from the dims (the trainer's
    ``RunPlan.layout``, ``k2-convert import``'s state file and the resume planner all take it from here)."""
    layout = _dims(8, pp=2, vpp=2, ep=2).checkpoint_layout()
    assert layout == {"pp": 2, "vpp": 2, "ep": 2, "dp": 4, "world_size": 8}


# ---------------------------------------------------------------------------- bad input

# (id, world_size, num_layers, num_moe_experts, parallel settings, substrings of the message)
BAD = [
    ("pp_world", 4, 4, 8, dict(pp=3), ["parallel.pp=3", "world size 4", "allowed pp for this world size: 1, 2, 4"]),
    ("tp", 2, 4, 8, dict(tp=2), ["parallel.tp=2", "allowed parallel.tp: 1"]),
    ("pp0", 1, 4, 8, dict(pp=0), ["parallel.pp=0", ">= 1"]),
    ("ep0", 1, 4, 8, dict(ep=0), ["parallel.ep=0", ">= 1"]),
    ("vpp0", 2, 4, 8, dict(pp=2, vpp=0), ["parallel.vpp", ">= 1"]),
    ("vpp_no_pp", 2, 4, 8, dict(vpp=2), ["parallel.vpp=2", "parallel.pp"]),
    (
        "layers_even",
        256,
        61,
        384,
        dict(pp=16, vpp=2, ep=16),
        ["model.num_layers=61", "parallel.pp=16", "parallel.vpp=2", "32 virtual stages", "29 over", "parallel.layout"],
    ),
    ("layers_pp", 3, 4, 8, dict(pp=3), ["model.num_layers=4", "parallel.pp=3", "allowed: 1, 2, 4"]),
    (
        "layout_and_first",
        2,
        4,
        8,
        dict(pp=2, layout="Ett|ttL", first_stage_layers=2),
        ["parallel.layout", "parallel.first_stage_layers"],
    ),
    (
        "layout_parse",
        2,
        4,
        8,
        dict(pp=2, layout="Etx|tttL"),
        ["parallel.layout='Etx|tttL'", "cannot be parsed", "E = embedding"],
    ),
    ("layout_parens", 2, 4, 8, dict(pp=2, layout="E(tt|*2L"), ["parallel.layout", "cannot be parsed"]),
    ("layout_pp", 2, 4, 8, dict(pp=2, layout="Et|tt|tL"), ["3 virtual stages", "parallel.pp=2"]),
    ("layout_vpp", 2, 4, 8, dict(pp=2, layout="Et|t|t|tL"), ["parallel.vpp=1", "set parallel.vpp=2"]),
    ("layout_vpp3", 2, 4, 8, dict(pp=2, vpp=3, layout="Et|t|t|tL"), ["parallel.vpp=3", "set parallel.vpp=2"]),
    ("layout_t_count", 2, 4, 8, dict(pp=2, layout="Et|tL"), ["places 2 decoder layers", "model.num_layers=4"]),
    ("layout_no_E", 2, 4, 8, dict(pp=2, layout="tt|ttL"), ["parallel.layout", "exactly one E", "0 E"]),
    ("layout_E_late", 2, 4, 8, dict(pp=2, layout="tEt|ttL"), ["parallel.layout", "first character"]),
    ("layout_L_early", 2, 4, 8, dict(pp=2, layout="Ett|tLt"), ["parallel.layout", "last character"]),
    ("layout_E_stage1", 2, 4, 8, dict(pp=2, layout="|EttttL"), ["parallel.layout", "first virtual stage"]),
    ("layout_mtp", 2, 4, 8, dict(pp=2, layout="Ett|ttmL"), ["parallel.layout", "MTP"]),
    ("layout_empty", 1, 4, 8, dict(layout=""), ["parallel.layout", "non-empty"]),
    (
        "first_vpp",
        4,
        12,
        8,
        dict(pp=4, vpp=2, first_stage_layers=3),
        ["parallel.first_stage_layers=3", "parallel.vpp=2"],
    ),
    (
        "first_middle",
        4,
        10,
        8,
        dict(pp=4, first_stage_layers=2),
        ["model.num_layers=10", "parallel.first_stage_layers=2", "leaves 8 layers", "3 middle PP ranks"],
    ),
    ("last_too_many", 4, 10, 8, dict(pp=4, last_stage_layers=12), ["parallel.last_stage_layers=12", "2 short"]),
    (
        "first_last_pp2_sum",
        2,
        10,
        8,
        dict(pp=2, first_stage_layers=4, last_stage_layers=4),
        ["parallel.first_stage_layers=4", "add up to model.num_layers=10"],
    ),
    ("first_pp1", 1, 4, 8, dict(first_stage_layers=4), ["parallel.first_stage_layers=4", "parallel.pp >= 2"]),
    ("first_zero", 4, 4, 8, dict(pp=2, first_stage_layers=0), ["parallel.first_stage_layers=0", ">= 1"]),
    ("experts_ep", 6, 4, 8, dict(ep=3), ["model.num_moe_experts=8", "parallel.ep=3", "allowed parallel.ep", "1, 2"]),
    ("ep_dp", 4, 4, 8, dict(pp=2, ep=4), ["parallel.ep=4", "dp=2", "allowed parallel.ep: 1, 2"]),
    ("ep_dense", 2, 4, None, dict(ep=2), ["parallel.ep=2", "model.num_moe_experts=None"]),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_config(case):
    _, world_size, num_layers, experts, par, needles = case
    with pytest.raises(ConfigError) as e:
        _dims(world_size, num_layers, experts, **par)
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_world_size_source_named():
    with pytest.raises(ConfigError, match=r"cluster.nodes x cluster.gpus_per_node"):
        ParallelDims.from_config(_par(pp=3), _model(), 8, world_size_from="cluster.nodes x cluster.gpus_per_node")


# ---------------------------------------------------------------------------- microbatches


def _megatron_interleaved_ok(m: int, pp: int) -> bool:
    """The checks of megatron-core 0.19.2 forward_backward_pipelining_with_interleaving, verbatim, with
    the default microbatch_group_size_per_vp_stage = pp."""
    group = pp
    if group > m or group < pp:
        return False
    final = m % group
    return not (0 < final < pp)


def test_microbatches_counts():
    assert check_microbatches(_dims(1), 16, 2) == 8
    assert check_microbatches(_dims(4, pp=2, vpp=2, ep=2), 16, 2) == 4
    assert check_microbatches(_dims(2, pp=2), 2, 2) == 1  # plain 1F1B accepts M < pp


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_microbatch_rule_matches_megatron(pp):
    dims = _dims(pp, num_layers=2 * pp, pp=pp, vpp=2)
    for m in range(1, 4 * pp + 2):
        ok = _megatron_interleaved_ok(m, pp)
        if ok:
            assert check_microbatches(dims, m, 1) == m
        else:
            with pytest.raises(ConfigError):
                check_microbatches(dims, m, 1)


@pytest.mark.parametrize(
    "world_size,par,gbs,mbs,needles",
    [
        (4, dict(), 10, 2, ["global_batch_size=10", "train.micro_batch_size=2", "dp=4", "multiples of 8"]),
        (4, dict(pp=2, vpp=2, ep=2), 2, 1, ["1 microbatches", "parallel.vpp=2", "parallel.pp=2", "multiples of 4"]),
        (4, dict(pp=2, vpp=2, ep=2), 6, 1, ["3 microbatches", "interleaved", "multiple of it"]),
        (1, dict(), 0, 1, ["global_batch_size=0"]),
        (1, dict(), 4, 0, ["train.micro_batch_size=0"]),
    ],
)
def test_bad_microbatches(world_size, par, gbs, mbs, needles):
    dims = _dims(world_size, **par)
    with pytest.raises(ConfigError) as e:
        check_microbatches(dims, gbs, mbs)
    for needle in needles:
        assert needle in str(e.value), f"{needle!r} not in {str(e.value)!r}"
