"""``k2-plan model=kimi_k2 plan.search=true`` on 64, 72 and 288 GPUs of each Blackwell profile: no batch and no
peak set by hand (the global batch rounded to one every phase can run, the peak the profile's), the verdict in
the first lines (fits or not, the recommended layout, its step and what dominates it, the parallel.* to set).

Each case runs one search (every layout of K2's schedule; seconds of CPU) and reads both outputs from it: the
JSON record ``k2-plan`` prints and the text ``format_text`` makes of that record (what ``output=text``
prints first). The unit suite runs four of the twelve (profile, GPU count) cases -- every profile once, every
GPU count at least once, fitting and not fitting -- and the other eight under the ``slow`` mark: a search
per case, twelve would take minutes of the suite's budget and check the same code four times over.
"""

from __future__ import annotations

import json

import pytest

from k2.launcher.plan import main
from k2.launcher.planning import format_text

#: GPUs per host of each profile (recipes/hardware/*.yaml gpus_per_host)
HOST_GPUS = {"b200": 8, "b300": 8, "gb200_nvl72": 4, "gb300_nvl72": 4}
PEAK_BF16 = {"b200": 2250, "b300": 2250, "gb200_nvl72": 2450, "gb300_nvl72": 2450}
#: the unit suite's cases: each profile once, each GPU count at least once, both verdicts (K2 does not fit
#: 64 B200 or 72 GB200; it fits 288 GB300 and 72 B300). 64 B300, the slowest case, is left to the slow set:
#: it fits with PP8 x VPP4, whose plan and three variants (each without one memory setting) are simulated
#: at full length, 2,048 microbatches
FAST = {("b200", 64), ("gb200_nvl72", 72), ("gb300_nvl72", 288), ("b300", 72)}
CASES = [
    pytest.param(profile, gpus, marks=() if (profile, gpus) in FAST else pytest.mark.slow)
    for profile in sorted(HOST_GPUS)
    for gpus in (64, 72, 288)
]


@pytest.mark.parametrize(("profile", "gpus"), CASES)
def test_kimi_k2_search_on_a_blackwell_cluster_prints_its_verdict_first(capsys, profile, gpus):
    per_host = HOST_GPUS[profile]
    args = [
        "model=kimi_k2",
        "plan.search=true",
        f"plan.hardware={profile}",
        f"cluster.nodes={gpus // per_host}",
        f"cluster.gpus_per_node={per_host}",
        "output=json",
    ]
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
    text = format_text(plan).splitlines()  # what output=text prints first (+ the data of each phase)
    assert text[0].startswith(f"verdict: kimi_k2 on {gpus} x {profile} ")
    assert ("FITS; recommended layout" in text[0]) == v["fits"]
    assert text[1].startswith("  step ") and "dominated by" in text[1]
    assert text[2].startswith("  parallel.tp=")
    header = "\n".join(text[:40])
    assert f"{PEAK_BF16[profile]}" in header or f"{PEAK_BF16[profile]:,}" in header  # the profile's peak


def test_the_text_output_is_format_text_of_the_json_record(capsys):
    """The search case above reads the text from the JSON record: ``output=text`` prints ``format_text`` of
    the same record (then the data of each phase), so a plan's two outputs cannot disagree (a small plan,
    no search: the formatting, not the planner)."""
    args = ["model=k2_tiny", "cluster.nodes=1", "cluster.gpus_per_node=1"]
    assert main([*args, "output=json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(format_text(plan) + "\n\ndata per phase")


def test_mxfp8_is_refused_on_hopper_in_one_line(capsys):
    """MXFP8 GEMMs are Blackwell's: on an H800 profile k2-plan stops with one line naming train.fp8_recipe and
    what the profile runs; on B200 it plans them."""
    assert main(["model=kimi_k2", "plan.hardware=h800", "cluster.nodes=32", "train.fp8_recipe=mxfp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0
        and "train.fp8_recipe=mxfp8: plan.hardware=h800" in err
        and "allowed: blockwise, or null" in err
    )
    assert (
        main(["model=kimi_k2", "plan.hardware=b200", "cluster.nodes=32", "train.fp8_recipe=mxfp8", "output=json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["gemm_precision"] == "mxfp8"


def test_a_profile_without_gpu_memory_says_what_it_planned_with(tmp_path, capsys):
    """A hand-written profile without gpu_memory_gib: under the plan's summary, a line says it planned with
    80 GiB and which setting gives the real figure."""
    import yaml

    from k2.config.hardware import HARDWARE_DIR

    data = yaml.safe_load((HARDWARE_DIR / "b300.yaml").read_text())
    del data["gpu_memory_gib"]
    path = tmp_path / "nomem.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["model=kimi_k2", f"plan.hardware={path}", "cluster.nodes=32", "parallel=k2_256gpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("plan: kimi_k2 parallel=k2_256gpu on 256 x b300 (32 nodes x 8): ")
    note = "note: plan.hardware=b300 gives no gpu_memory_gib: planned with 80 GiB per GPU (set cluster.gpu_memory_gib)"
    assert note in lines[:5]
