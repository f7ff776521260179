"""k2-bench runs that start ranks: bench=pipeline (decoupled wgrad off and on, real k2-train runs),
bench=memory (five activation-memory settings on a parallel layout) and bench=optimizer's DP=2 ZeRO-1
cases (byte-range Distributed Muon with and without offload, layer-wise). The ranks these benches spawn
are forked by the tests' fork server instead (tests/support/distributed.py ``start_processes_forked``):
the same functions on the same arguments, without a fresh interpreter's imports per rank.
"""

from __future__ import annotations

import json

import pytest

from k2.launcher.bench import main
from support.helpers import run_tool


@pytest.mark.slow
def test_pipeline_bench_times_off_and_on_in_one_run(capsys, stdlib_corpus, monkeypatch):
    """bench=pipeline: two real trainer runs (pp2 here, to keep the test short), off then on; the same
    losses, both step times, the deferred-bytes peak (the numbers, not the speed, are checked). The two
    runs' ranks are forked by the tests' fork server (tests/support/distributed.py ``rank_launch_cmd``)
    instead of two fresh k2-train interpreters (k2-train's own launch: tests/integration/test_train_run.py)."""
    from k2.launcher.benchmarks import pipeline
    from support.distributed import rank_launch_cmd

    monkeypatch.setattr(
        pipeline,
        "trainer_command",
        lambda overrides, nproc: rank_launch_cmd(nproc, ["-m", "k2.launcher.train"], overrides),
    )
    rc, out, err = run_tool(
        capsys,
        main,
        [
            "bench=pipeline",
            "output=json",
            "bench.options.parallel=pp2",
            "bench.options.nproc=2",
            "bench.options.iters=3",
            "bench.options.devices=cpu",
        ],
    )
    assert rc == 0, err
    cpu = json.loads(out)["figures"]["cpu"]
    assert cpu["parallel"] == "pp2" and cpu["ranks"] == 2 and cpu["timed_steps_per_config"] == 2
    assert cpu["max_loss_rel_diff"] == 0.0  # the split changes no number
    assert min(cpu["step_time_off_ms"], cpu["step_time_on_ms"]) > 0
    assert cpu["on_over_off"] == pytest.approx(cpu["step_time_on_ms"] / cpu["step_time_off_ms"])
    assert cpu["wgrad_deferred_peak_bytes"] > 0
    assert min(cpu["pass_cpu_s_off"], cpu["pass_cpu_s_on"]) > 0
    assert cpu["pass_cpu_on_over_off"] == pytest.approx(cpu["pass_cpu_s_on"] / cpu["pass_cpu_s_off"])


@pytest.fixture
def forked_ranks(monkeypatch):
    """The benches' ``torch.multiprocessing.start_processes`` (spawned ranks) through the fork server."""
    import torch.multiprocessing

    from support.distributed import start_processes_forked

    monkeypatch.setattr(torch.multiprocessing, "start_processes", start_processes_forked)


@pytest.mark.slow
def test_memory_bench_five_settings_in_one_run(capsys, forked_ranks):
    """bench=memory: one JSON object keyed by the five settings, each with saved_bytes and step_s,
    measured through the hooks (one rank here to keep it short; the documented run is cpu4)."""
    rc, out, _ = run_tool(
        capsys,
        main,
        [
            "bench=memory",
            "output=json",
            "bench.options.parallel=single",
            "bench.options.warmup=0",
            "bench.options.steps=1",
        ],
    )
    assert rc == 0
    fig = json.loads(out)["figures"]
    assert list(fig) == ["none", "fp8", "recompute", "offload", "all"]
    for f in fig.values():
        assert f["saved_bytes"] > 0 and f["step_s"] > 0
    none = fig["none"]["saved_bytes"]
    assert fig["fp8"]["fp8_sites_cut"] >= 0.45
    assert fig["fp8"]["saved_bytes"] < none and fig["recompute"]["saved_bytes"] < none
    assert fig["offload"]["saved_bytes"] < none and fig["offload"]["host_bytes"] > 0
    assert fig["all"]["saved_bytes"] < min(fig[s]["saved_bytes"] for s in ("fp8", "recompute", "offload"))


@pytest.mark.slow
def test_optimizer_bench_dp2_zero1_cases_in_one_run(capsys, forked_ranks):
    """bench=optimizer on DP=2: the byte-range step (with a straddling matrix gathered), the same with the
    optimizer states offloaded, and megatron's layer-wise step, timed in one run, with their ratios (the
    numbers, not the speed, are checked)."""
    rc, out, err = run_tool(
        capsys, main, ["bench=optimizer", "output=json", "bench.options.repeats=1", "bench.options.warmup=0"]
    )
    assert rc == 0, err
    fig = json.loads(out)["figures"]
    assert fig["dp2_straddling_muon_matrices"] >= 1
    t = {k: fig[f"time_dp2_{k}_ms"] for k in ("byte_range", "byte_range_offload", "layer_wise")}
    assert min(t.values()) > 0
    assert fig["byte_range_over_layer_wise"] == pytest.approx(t["byte_range"] / t["layer_wise"])
    assert fig["offload_over_no_offload"] == pytest.approx(t["byte_range_offload"] / t["byte_range"])
    assert fig["gpu"].startswith("no GPU was lent") or "CUDA" in fig["gpu"]
