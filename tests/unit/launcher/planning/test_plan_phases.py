"""k2-plan plans every phase: the fullest GPU and the host memory of the fullest node of each phase that
runs, against ``cluster.gpu_memory_gib`` and ``cluster.host_memory_gib``; ``fits`` only when every phase
fits both. Which GPUs share a node is taken from megatron-core's own ``RankGenerator`` (the reference),
not from the planner's rank arithmetic."""

from __future__ import annotations

import json
import warnings

import pytest

from k2.config.load import load_config
from k2.launcher.plan import main

TINY_CPU4 = ["model=k2_tiny", "parallel=cpu4", "cluster.nodes=1", "cluster.gpus_per_node=4", "memory=k2"]


def _plan(overrides):
    from k2.launcher.planning.cluster import plan_cluster

    return plan_cluster(load_config(overrides)).report


def _analyse(overrides):
    from k2.launcher.planning.analysis import analyse_layout
    from k2.launcher.planning.search import WORLD_FROM
    from k2.model.params import count_params
    from k2.parallel.dims import ParallelDims
    from k2.schedules.resolve import resolve_schedule

    cfg = load_config(overrides)
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world, world_size_from=WORLD_FROM)
    return cfg, dims, analyse_layout(cfg, dims, count_params(cfg), resolve_schedule(cfg, dims))


def _pp_rank_by_megatron(dims) -> dict[int, int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator
    gen = RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=dims.pp, cp=1, order="tp-cp-ep-dp-pp")
    return {rank: i for group in gen.get_ranks("pp") for i, rank in enumerate(group)}


def test_every_running_phase_has_a_row_and_host_per_node():
    from k2.launcher.planning.analysis import gpu_memory_gib, host_memory_gib

    cfg, dims, a = _analyse(TINY_CPU4)
    assert [row["phase"] for row in a["phases"]] == ["warmup", "stable", "decay", "anneal_128", "anneal_512"]
    pp_of = _pp_rank_by_megatron(dims)
    gib = 2**30
    by_ctx = {}
    for row in a["phases"]:
        res = next(r for r in a["results"].values() if row["phase"] in r["phases"])
        mem = res["memory"]
        # host of the one node: every rank's offloaded bytes (optimizer + activations at peak), plus the
        # copy an asynchronous checkpoint save (the default) stages there, as pinned blocks
        # (launcher/planning/host_pinned.py)
        from k2.launcher.planning.checkpoint import staged_bytes_per_node
        from k2.model.params import count_params

        staged = staged_bytes_per_node(cfg, count_params(cfg).total, dims.world_size) * a["staged_pinned_ratio"]
        want = staged + sum(mem[pp_of[r]].host_pinned for r in range(4))
        assert want > 0 and row["host_bytes_per_node"] == pytest.approx(want)
        assert a["staged_pinned_ratio"] >= 1 and all(g.host_pinned >= g.host for g in mem)
        assert row["device_peak_bytes"] == pytest.approx(
            max(g.params + g.grads + g.optimizer + g.activations + g.transient + g.reserved for g in mem)
        )
        assert row["fits_gpu"] == (row["device_peak_bytes"] <= gpu_memory_gib(cfg) * gib)
        assert row["fits_host"] == (row["host_bytes_per_node"] <= host_memory_gib(cfg) * gib)
        assert row["memory"]["recompute"] == sorted(cfg.memory.recompute)
        by_ctx[row["seq_length"]] = row
    # the 512-token anneal holds more activations (and offloads more) than the 128-token phases
    assert by_ctx[512]["activation_bytes"] > by_ctx[128]["activation_bytes"]
    assert by_ctx[512]["host_bytes_per_node"] > by_ctx[128]["host_bytes_per_node"]
    assert a["fits"] == all(row["fits"] for row in a["phases"])


def test_fits_needs_every_phase_on_gpu_and_host(capsys):
    base = _plan(TINY_CPU4)
    rows = {r["phase"]: r for r in base["phases"]}
    assert base["fits"] and all(r["fits"] for r in rows.values())
    # host memory between the 128-token and the 512-token phases' needs: only the anneal fails, on host
    lo, hi = rows["anneal_128"]["host_bytes_per_node"], rows["anneal_512"]["host_bytes_per_node"]
    host_gib = (lo + hi) / 2 / 2**30
    small = _plan(TINY_CPU4 + [f"cluster.host_memory_gib={host_gib}"])
    verdict = {r["phase"]: (r["fits_gpu"], r["fits_host"]) for r in small["phases"]}
    assert verdict["anneal_128"] == (True, True) and verdict["anneal_512"] == (True, False)
    assert small["fits"] is False
    # GPU memory between the phases' device peaks: the anneal fails on the GPU
    lo, hi = rows["anneal_128"]["device_peak_bytes"], rows["anneal_512"]["device_peak_bytes"]
    rc = main(TINY_CPU4 + [f"cluster.gpu_memory_gib={(lo + hi) / 2 / 2**30}"])
    out = capsys.readouterr().out
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("anneal_512"))
    assert "NO (GPU)" in line and "the plan does NOT fit: phases anneal_512 do not" in out
    rc = main(TINY_CPU4 + ["output=json"])
    plan = json.loads(capsys.readouterr().out)
    # cluster.host_memory_gib unset: the h800 profile's 2,048 GiB per 8-GPU host, for a node of 4 GPUs
    assert [r["phase"] for r in plan["phases"]] == list(rows) and plan["host_memory_bytes_per_node"] == 1024 * 2**30


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_host_memory_setting_checked(capsys, value):
    rc = main(TINY_CPU4 + [f"cluster.host_memory_gib={value}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("k2-plan: error: ") and "cluster.host_memory_gib" in err
    assert err.count("\n") == 1


def test_k2_plans_and_fits_every_phase_on_its_cluster(capsys):
    """K2's run as model=kimi_k2 selects it (train=k2, memory=k2, k2_15t5 with whole-layer recompute in the
    32K anneal) on K2's 32 x 8 H800 GPUs: every phase from warmup to the 32K anneal fits 80 GiB per GPU
    and 2,048 GiB per node."""
    rc = main(["model=kimi_k2", "parallel=k2_256gpu", "cluster.nodes=32", "cluster.gpus_per_node=8", "output=json"])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {r["phase"]: r for r in plan["phases"]}
    assert list(rows) == ["warmup", "stable", "decay", "anneal_4k", "anneal_32k"]
    for r in rows.values():
        assert r["device_peak_bytes"] <= 80 * 2**30 and r["host_bytes_per_node"] <= 2048 * 2**30, r
        assert r["fits"] and r["micro_batch_size"] == 1
    assert plan["fits"] is True and plan["memory_per_gpu_bytes"]["params"] < plan["memory_per_gpu_bytes"]["grads"]
    k32, k4 = rows["anneal_32k"], rows["stable"]
    assert "layer" in k32["memory"]["recompute"] and "layer" not in k4["memory"]["recompute"]
    # what the whole-layer recompute costs: the 32K step re-runs every layer's forward in backward
    assert k32["recompute_time_s_estimated"] > 3 * k4["recompute_time_s_estimated"] > 0
    assert k32["recompute_time_s_estimated"] < 0.5 * k32["step_time_s_estimated"]


@pytest.mark.parametrize("size, nodes", [("1node", 1), ("4node", 4)])
def test_small_cluster_sweeps_fit(size, nodes):
    """The sparsity sweeps for one and four 8-GPU nodes: k2-plan says the sweep's largest point (the most
    experts: the most parameters per GPU) fits every phase, on the cluster the parallel recipe names."""
    cfg = load_config([f"+experiment=sparsity_sweep_{size}"])
    assert cfg.model.name == f"k2_{size}" and cfg.parallel.name == f"k2_{size}"
    assert list(cfg.sweep.sparsities) == [8, 16, 32, 48] and cfg.model.moe_router_topk == 8
    experts = max(cfg.sweep.sparsities) * cfg.model.moe_router_topk
    plan = _plan([f"+experiment=sparsity_sweep_{size}", f"model.num_moe_experts={experts}"])
    assert (plan["world_size"], plan["nodes"], plan["params"]["num_experts"]) == (8 * nodes, nodes, 384)
    assert plan["fits"] and all(r["fits"] for r in plan["phases"])
    assert plan["memory_per_gpu_bytes"]["total"] < 80 * 2**30


def test_the_hardware_profile_sets_the_gpu_memory_it_plans_with():
    """plan.hardware=h200 plans an H200's memory, with K2's recipe too; h800 (the default) an 80 GiB
    GPU's; cluster.gpu_memory_gib set by hand still wins."""
    gib = lambda ov: _plan(ov)["cluster"]["gpu_memory_gib"]  # noqa: E731
    assert gib(TINY_CPU4 + ["plan.hardware=h200"]) == 141.0
    assert gib(["model=kimi_k2", "parallel=k2_256gpu", "plan.hardware=h200"]) == 141.0
    assert gib(TINY_CPU4) == 80.0
    assert gib(TINY_CPU4 + ["plan.hardware=h200", "cluster.gpu_memory_gib=96"]) == 96.0
