"""``k2-plan model=kimi_k2 plan.search=true`` on 64, 72 and 288 GPUs of each Blackwell profile: no batch and no
peak set by hand (the global batch rounded to one every phase can run, the peak the profile's), the verdict in
the first lines (fits or not, the recommended layout, its step and what dominates it, the parallel.* to set).
Each search plans every layout of K2's schedule: minutes per case on a CPU, hence slow."""

from __future__ import annotations

import json

import pytest

from k2.launcher.plan import main

#: GPUs per host of each profile (recipes/hardware/*.yaml gpus_per_host)
HOST_GPUS = {"b200": 8, "b300": 8, "gb200_nvl72": 4, "gb300_nvl72": 4}
PEAK_BF16 = {"b200": 2250, "b300": 2250, "gb200_nvl72": 2450, "gb300_nvl72": 2450}


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [64, 72, 288])
@pytest.mark.parametrize("profile", sorted(HOST_GPUS))
def test_kimi_k2_search_on_a_blackwell_cluster_prints_its_verdict_first(capsys, profile, gpus):
    per_host = HOST_GPUS[profile]
    args = ["model=kimi_k2", "plan.search=true", f"plan.hardware={profile}", f"cluster.nodes={gpus // per_host}",
            f"cluster.gpus_per_node={per_host}", "output=json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    v = plan["verdict"]
    if v["fits"]:  # the fastest fitting layout; else the closest (the least memory per GPU)
        assert v["recommended"] == plan["search"][0]
    else:
        key = ("tp", "pp", "vpp", "ep")
        assert [v["recommended"][k] for k in key] in [[r[k] for k in key] for r in plan["search"]]
        assert v["smallest_fitting_gpus"] > gpus
    assert v["step_time_s_estimated"] > 0 and v["dominant"]
    assert plan["world_size"] == gpus
    assert main(args[:-1]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith(f"verdict: kimi_k2 on {gpus} x {profile} ")
    assert ("FITS; recommended layout" in text[0]) == v["fits"]
    assert text[1].startswith("  step ") and "dominated by" in text[1]
    assert text[2].startswith("  parallel.tp=")
    header = "\n".join(text[:40])
    assert f"{PEAK_BF16[profile]}" in header or f"{PEAK_BF16[profile]:,}" in header  # the profile's peak
