"""plan.search's verdict (launcher/planning/verdict.py): printed first, the plan below it of the layout it
recommends, the smallest GPU count that fits when nothing does, the memory settings a larger GPU does not
need. k2_tiny with K2's memory settings on "GPUs" of a few hundredths of a GiB (its sizes: the search's rows
on 2 GPUs need 0.0353-0.0434 GiB), without the fixed GPU terms of plan.gpu_overheads."""

from __future__ import annotations

import json

from k2.launcher.plan import main
from k2.launcher.planning import format_text

NO_GPU_OVERHEADS = [
    f"plan.gpu_overheads.{k}=0"
    for k in ("cuda_context_gib", "nccl_gib_per_communicator", "workspace_gib", "fragmentation")
]


def _plan(capsys, gib: float, gpus: int = 2, *extra: str) -> tuple[list[str], dict]:
    """One ``k2-plan`` run (``output=json``): its record and the lines ``output=text`` prints first, which are
    ``format_text`` of the same record (a second search would only repeat it: test_search_new_profiles.py's
    ``test_the_text_output_is_format_text_of_the_json_record`` checks that the two outputs agree)."""
    base = [
        "model=k2_tiny",
        "memory=k2",
        "cluster.nodes=1",
        f"cluster.gpus_per_node={gpus}",
        "plan.search=true",
        f"cluster.gpu_memory_gib={gib}",
        *NO_GPU_OVERHEADS,
        *extra,
    ]
    assert main([*base, "output=json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    return format_text(plan).splitlines(), plan


def test_the_verdict_comes_first_and_the_plan_is_of_the_recommended_layout(capsys):
    """0.036 GiB: only the PP2 layouts fit (0.0353 / 0.0359 GiB) and need every memory setting. The verdict
    is the first line; the plan under it is of the recommended layout, not of parallel.pp=4, which does not
    even divide the 2 GPUs (without plan.search k2-plan refuses it)."""
    text, plan = _plan(capsys, 0.036, 2, "parallel.pp=4")
    v = plan["verdict"]
    assert text[0].startswith("verdict: k2_tiny on 2 x ") and ": FITS; recommended layout PP2 " in text[0]
    assert v["fits"] and v["recommended"]["pp"] == 2 and v["recommended"] == plan["search"][0]
    assert (plan["pp"], plan["ep"], plan["parallel"]) == (2, 1, "search")
    assert v["step_time_s_estimated"] == plan["step_time_s_estimated"]
    assert [t for t, _ in v["dominant"]] == sorted(
        plan["step_time_breakdown_s"], key=lambda k: -plan["step_time_breakdown_s"][k]
    )[:2]
    assert v["unneeded_memory_settings"] == []
    assert text[3].startswith("  every memory setting is needed to fit: memory.offload, memory.recompute")


def test_when_nothing_fits_it_names_the_smallest_gpu_count_that_does(capsys):
    """0.03 GiB: nothing fits on 2 GPUs; on 4 a PP4 layout does, which a search there confirms."""
    text, plan = _plan(capsys, 0.03, 2)
    v = plan["verdict"]
    assert not v["fits"] and v["smallest_fitting_gpus"] == 4
    assert ": does NOT fit; closest (the least memory per GPU) layout PP2 " in text[0]
    assert v["recommended"]["memory_per_gpu_bytes"] == min(r["memory_per_gpu_bytes"] for r in plan["search"])
    assert "  smallest GPU count that fits: 4 (2 nodes;" in "\n".join(text[:5])
    _, four = _plan(capsys, 0.03, 4)
    assert four["verdict"]["fits"]


def test_the_memory_settings_a_larger_gpu_does_not_need(capsys):
    """1 GiB: every memory setting of K2's is dropped one at a time and the layout still fits; the step
    printed for each is the plan's without it (recompute off: no recomputed forward, no longer a step)."""
    text, plan = _plan(capsys, 1.0, 2)
    v = plan["verdict"]
    un = {u["setting"]: u for u in v["unneeded_memory_settings"]}
    assert set(un) == {"memory.offload", "memory.recompute", "memory.fp8_store"} == set(v["memory_settings_set"])
    assert un["memory.recompute"]["was"] == ["layernorm", "swiglu", "mla_up_proj", "moe_down_proj"]
    # (no longer: k2_tiny's step on a GPU profile is host-bound, the host term; the recomputed forward's
    # GPU work hides behind the host's time, so dropping it cannot lengthen the step)
    assert un["memory.recompute"]["step_time_s"] <= v["step_time_s_estimated"] * (1 + 1e-9)
    r = v["recommended"]
    _, without = _plan(
        capsys,
        1.0,
        2,
        "memory.recompute=[]",
        "plan.search=false",
        f"parallel.pp={r['pp']}",
        f"parallel.ep={r['ep']}",
        f"parallel.vpp={r['vpp'] if r['vpp'] > 1 else 'null'}",
        f"parallel.layout={r['layout']}",
    )
    assert without["step_time_s_estimated"] == un["memory.recompute"]["step_time_s"]
    line = "  not needed on this GPU: memory.recompute (memory.recompute=[]: it still fits; step "
    assert any(x.startswith(line) for x in text[:8])


def test_the_fastest_memory_settings_are_dropped_together_greedily(monkeypatch):
    """Dropped alone, recompute lengthens the step (what it dropped is offloaded instead); once offload is
    dropped, dropping recompute too shortens it. The verdict drops offload first (the best alone), then
    recompute on top; fp8 storage would no longer fit, so it stays. A step model of the overrides applied."""
    from omegaconf import OmegaConf

    from k2.launcher.planning import verdict

    def fits(cfg, world, counts):
        off = {k for k in ("offload", "recompute", "fp8_store") if not OmegaConf.select(cfg, f"memory.{k}")}
        steps = {
            frozenset(): 100.0,
            frozenset({"offload"}): 70.0,
            frozenset({"recompute"}): 150.0,
            frozenset({"fp8_store"}): 120.0,
            frozenset({"offload", "recompute"}): 60.0,
        }
        fit = len(off) < 3 and off != {"offload", "fp8_store"}  # fp8 storage is needed once offload is dropped
        return fit, steps.get(frozenset(off), 999.0)

    monkeypatch.setattr(verdict, "_fits", fits)
    cfg = OmegaConf.create(
        {"memory": {"offload": ["a"], "recompute": ["b"], "fp8_store": ["c"]}, "optim": {"offload_fraction": 0.0}}
    )
    unneeded = [
        {"off": "memory.offload=[]", "step_time_s": 70.0},
        {"off": "memory.recompute=[]", "step_time_s": 150.0},
        {"off": "memory.fp8_store=[]", "step_time_s": 120.0},
    ]
    fast = verdict.faster_memory_settings(cfg, 2, None, 100.0, unneeded)
    assert fast == {"overrides": ["memory.offload=[]", "memory.recompute=[]"], "step_time_s": 60.0}
    # nothing shorter than the step: no recommendation
    assert verdict.faster_memory_settings(cfg, 2, None, 50.0, unneeded) is None


def test_the_smallest_fitting_count_is_scanned_node_by_node_below_the_first_multiple(monkeypatch):
    """From 9 nodes: 18 (x2) is the first multiple that fits, and every count from 10 up is tried below it,
    so 13 is found (a search of doublings alone said 18); a wider stretch (from 2 nodes: 128 fits, 64 does
    not) is bisected first (96 fits), then scanned from 65: 90."""
    from k2.config import load_config
    from k2.launcher.planning import verdict

    tried = []

    def fake_candidates(cfg, world, counts, stop_at_fit=False):
        tried.append(int(cfg.cluster.nodes))
        yield None, {"fits": int(cfg.cluster.nodes) >= 13}

    monkeypatch.setattr(verdict, "layout_candidates", fake_candidates)
    cfg = load_config(["model=k2_tiny", "cluster.nodes=9", "cluster.gpus_per_node=8"])
    assert verdict.smallest_fitting_world(cfg, None) == (104, "every node count from 10 up")
    assert tried == [18, 10, 11, 12, 13]
    tried.clear()
    monkeypatch.setattr(
        verdict, "layout_candidates", lambda cfg, *a, **k: iter([(None, {"fits": int(cfg.cluster.nodes) >= 90})])
    )
    two = load_config(["model=k2_tiny", "cluster.nodes=2", "cluster.gpus_per_node=8"])
    assert verdict.smallest_fitting_world(two, None) == (
        90 * 8,
        "bisection between 64 and 128 nodes, then every node count up",
    )


def test_a_verdict_that_does_not_fit_names_the_limit_that_fails(capsys):
    """GPU memory ample, the host's too small for what the recipe offloads: the verdict's memory line says
    host memory is the limit, with its figures per node."""
    text, plan = _plan(capsys, 10.0, 2, "cluster.host_memory_gib=1e-6")
    v = plan["verdict"]
    assert not v["fits"] and v["fits_gpu"] and not v["fits_host"]
    assert "(over: host memory: " in text[1] and " GiB per node)" in text[1]


def test_a_global_batch_no_layout_can_run_is_rounded_to_the_nearest_one_that_some_layout_can(capsys):
    """7 GPUs and k2_tiny's 4 layers: only PP1 x DP7 is a layout, and 2,048 tokens (16 sequences of 128,
    then 4 of 512) split into no 7 DP ranks; the nearest batch that does in both phases is 3,584 tokens
    (7 x 2 x 128 and 7 x 1 x 512 divide it), said in one line, and the plan is of that batch."""
    text, plan = _plan(capsys, 10.0, 7)
    v = plan["verdict"]
    assert v["global_batch_rounded"] == {"from": 2048, "to": 3584} and v["recommended"]["dp"] == 7
    assert plan["global_batch_tokens"] == 3584
    line = next(ln for ln in text if "global batch rounded" in ln)
    assert "schedule.global_batch_tokens=3,584 (was 2,048" in line


def test_a_plan_without_the_search_starts_with_its_own_summary(capsys):
    """No plan.search: the first line still says whether the given layout fits (here not: which limit, in
    which phases, and that plan.search finds a layout), the second its step and memory."""
    base = ["model=k2_tiny", "memory=k2", "cluster.nodes=1", "cluster.gpus_per_node=2", *NO_GPU_OVERHEADS]
    assert main([*base, "cluster.gpu_memory_gib=0.001", "output=json"]) == 0
    text = format_text(json.loads(capsys.readouterr().out)).splitlines()
    assert text[0].startswith("plan: k2_tiny parallel=") and ": does NOT fit (GPU memory in " in text[0]
    assert text[0].endswith("; plan.search=true finds a layout)") and text[1].startswith("  step ")
    assert main([*base, "cluster.gpu_memory_gib=10", "output=json"]) == 0
    assert format_text(json.loads(capsys.readouterr().out)).splitlines()[0].endswith(": FITS")
