"""``k2-bench bench=ep_overlap`` without running it: it refuses in one line where it cannot shape a link
(no root), refuses bad options before any namespace exists, and reads the exposed all-to-all time of a
step from a trace the way its docstring says (the all-to-alls the rank's own thread ran, or its waits for
communication nodes)."""

from __future__ import annotations

import pytest

from k2.config.errors import ConfigError


def test_without_root_it_says_so_in_one_line(monkeypatch, capsys, no_process_start):
    import os

    from k2.launcher import bench

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert bench.main(["bench=ep_overlap"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs root" in err[0] and "tc tbf" in err[0], err


@pytest.mark.parametrize(
    "option, words",
    [
        ("rates=[0]", "bench.options.rates"),
        ("balance=[]", "bench.options.balance"),
        ("iters=1", "bench.options.iters=1"),
    ],
)
def test_bad_options_are_refused_first(option, words):
    from k2.config.load import load_config
    from k2.launcher.benchmarks.ep_overlap import bench_ep_overlap

    with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
        bench_ep_overlap(load_config(["bench=ep_overlap", f"bench.options.{option}"]))


def _ev(kind, start, end, **kw):
    return {"step": 2, "pass": "train", "kind": kind, "start": start, "end": end, **kw}


def test_exposed_all_to_all_time_of_a_step():
    from k2.launcher.benchmarks.ep_overlap_trace import exposed as _exposed

    off = [
        _ev("F", 0, 1),
        _ev("a2a", 0.2, 0.5, what="dispatch", thread="MainThread"),
        _ev("post", 0.2, 0.2, what="dispatch"),
        _ev("wait", 0.5, 0.5, what="dispatch"),
        _ev("a2a", 0.6, 0.7, what="combine", thread="MainThread"),
        _ev("B", 1, 2),
    ]
    assert _exposed(off, 2) == pytest.approx(0.4)
    on = [
        _ev("post", 0.1, 0.1, what="dispatch"),
        _ev("a2a", 0.1, 0.6, what="dispatch", thread="k2-comm-stream"),
        _ev("F", 0.1, 0.4),
        _ev("wait", 0.4, 0.6, what="dispatch"),
        _ev("wait", 0.9, 0.95, what="combine"),
        _ev("wait", 1.0, 1.5, label="recv_prev"),
    ]  # (a pipeline receive is not an all-to-all)
    assert _exposed(on, 2) == pytest.approx(0.25)
    assert _exposed(on, 3) == 0


def test_profiles_measured_before_and_after_the_runs_are_merged_key_by_key():
    """The bench predicts on the median of the profiles measured before and after its runs: two numbers
    give their mean, an integer setting stays an integer one (a profile whose ``gemm_tile`` became 1.0
    was refused by the schema), mappings merge key by key, text comes from the first."""
    from k2.launcher.benchmarks.perf_model import median_measurement

    before = {"kernel_launch_us": 20.0, "gemm_tile": 1, "operator_us": {"loss": 40.0}, "name": "a"}
    after = {"kernel_launch_us": 30.0, "gemm_tile": 1, "operator_us": {"loss": 50.0}, "name": "b"}
    merged = median_measurement([before, after])
    assert merged == {"kernel_launch_us": 25.0, "gemm_tile": 1, "operator_us": {"loss": 45.0}, "name": "a"}
    assert type(merged["gemm_tile"]) is int
    assert median_measurement([3, 1, 2]) == 2 and median_measurement([1.0, 4.0]) == 2.5


def test_compute_scale_makes_the_unshaped_prediction_the_measured_step(tmp_path):
    """``compute_scale`` scales the profile's compute (rates down, per-operator costs up) and nothing of its
    links, so that the model's unshaped step equals the measured one: a calibration run 1.3x slower than
    predicted gives a profile whose prediction is that run's step."""
    import yaml

    from k2.config.recipes import RECIPES_DIR
    from k2.launcher.benchmarks import ep_overlap as eo
    from k2.launcher.benchmarks import ep_overlap_prediction as ep

    o = dict(eo._DEFAULTS)
    device = yaml.safe_load((RECIPES_DIR / "hardware" / "h800.yaml").read_text())
    # as the bench's own profile, measured on this CPU: the host's time per operator is in its operator
    # costs, no host term (the host term's max(host, GPU) would not scale with one compute factor)
    device.update(host_forward_operator_us=0.0, host_backward_operator_us=0.0)
    link = {
        "rate_mbit": None,
        "alltoall_gbps": 0.06,
        "collective_gbps": 0.05,
        "latency_us": 60.0,
        "host_cpu_share": 0.05,
    }
    predicted = ep.predicted(o, ep.write_link_profile(link, device, tmp_path / "a.yaml"))["off"]["step_s"]
    measured = {"run": {"step_s": [1.3 * predicted]}, "link": link}
    u = ep.unshaped_case(o, measured, device, tmp_path)
    assert u["unshaped_predicted_over_measured_off"] == pytest.approx(1 / 1.3)
    calibrated = ep.calibrated(device, u["compute_scale"])
    assert u["compute_scale"] > 1.3  # (the link's share of the step does not scale)
    assert calibrated["kernel_launch_us"] == pytest.approx(device["kernel_launch_us"] * u["compute_scale"])
    assert calibrated["gemm_bf16_tflops"] == pytest.approx(device["gemm_bf16_tflops"] / u["compute_scale"])
    assert all(calibrated[k] == device[k] for k in device if k.startswith(("network", "nvlink")))
    again = ep.predicted(o, ep.write_link_profile(link, calibrated, tmp_path / "b.yaml"))["off"]["step_s"]
    assert again == pytest.approx(1.3 * predicted, rel=1e-6)


def test_each_rate_is_calibrated_by_its_own_unshaped_run(tmp_path):
    """The machine's speed drifts between rates, so each rate's calibrated prediction takes its compute from
    the unshaped run just before that rate's runs: two rates measured alike, whose calibration runs were
    1.2x and 1.5x the model's unshaped step, get those runs' compute scales and predictions in that ratio's
    direction (one calibration for the whole run gave both the first rate's)."""
    import yaml

    from k2.config.recipes import RECIPES_DIR
    from k2.launcher.benchmarks import ep_overlap as eo
    from k2.launcher.benchmarks import ep_overlap_prediction as ep

    o = dict(eo._DEFAULTS)
    device = yaml.safe_load((RECIPES_DIR / "hardware" / "h800.yaml").read_text())
    unshaped_link = {
        "rate_mbit": None,
        "alltoall_gbps": 0.06,
        "collective_gbps": 0.05,
        "latency_us": 60.0,
        "host_cpu_share": 0.5,
        "loaded_latency_us": 60.0,
    }
    base = ep.predicted(o, ep.write_link_profile(unshaped_link, device, tmp_path / "u.yaml"))["off"]["step_s"]
    run = {
        "step_s": [2.0],
        "exposed_s": [0.5],
        "pass_s": [1.9],
        "loss": [3.0],
        "peer_wait_s": [0.9],
        "a2a_nodes": [900],
    }
    cases = []
    for rate, factor in ((100.0, 1.2), (140.0, 1.5)):
        measured = {
            "link": {**unshaped_link, "rate_mbit": rate, "loaded_latency_us": 900.0},  # (the same link)
            "runs": {False: [run], True: [run]},
            "unshaped": {"run": {"step_s": [factor * base]}, "link": unshaped_link},
        }
        cases.append(eo._rate_case(o, measured, device, tmp_path / f"r{rate:g}"))
    assert [c["unshaped_predicted_over_measured_off"] for c in cases] == pytest.approx([1 / 1.2, 1 / 1.5])
    assert cases[0]["compute_scale"] < cases[1]["compute_scale"]
    assert cases[0]["calibrated_predicted_off_s"] < cases[1]["calibrated_predicted_off_s"]
    assert cases[0]["link_loaded_latency_us"] == 900.0
    # the goals judge what the overlap changes; the raw timings and the profiles predicted with go to the file
    c = cases[0]
    assert c["calibrated_predicted_over_measured_speedup"] == pytest.approx(c["calibrated_predicted_speedup"] / 1.0)
    assert c["calibrated_predicted_over_measured_exposed_on"] == pytest.approx(
        c["calibrated_predicted_exposed_a2a_on_s"] / 0.5
    )
    assert set(c["goals"]) == set(eo.GOALS) and c["goals_met"] == all(c["goals"].values())
    assert c["raw"]["off_runs"] == [run] and c["raw"]["unshaped"]["run"]["step_s"] == [1.2 * base]
    assert c["profile"]["network_loaded_latency_us"] == 900.0 and c["profile"]["comm_stream"] == "host_thread"


def test_goals_are_the_prediction_without_the_overlap_and_bounds_with_it():
    """A rate meets its goals when the calibrated model predicts the exposed all-to-all without the overlap
    within 15%, and with the overlap on its exposed all-to-all is at most the measured one (a lower bound)
    and its speed-up at least the measured one (an upper bound); the measured gain is no goal."""
    from k2.launcher.benchmarks import ep_overlap as eo

    case = {
        "speedup": 1.2,
        "exposed_cut": 0.5,
        "calibrated_predicted_over_measured_speedup": 1.05,
        "calibrated_predicted_over_measured_exposed_on": 0.8,
        "calibrated_predicted_over_measured_exposed_off": 0.9,
    }
    assert all(eo.goals_met(case).values())
    assert eo.goals_met({**case, "calibrated_predicted_over_measured_exposed_on": 1.2}) == {
        "exposed_off_prediction": True,
        "exposed_on_bound": False,
        "speedup_bound": True,
    }
    assert not eo.goals_met({**case, "calibrated_predicted_over_measured_speedup": 0.95})["speedup_bound"]
    assert not eo.goals_met({**case, "calibrated_predicted_over_measured_exposed_off": 0.8})["exposed_off_prediction"]


def _a2a(rank, start, what="dispatch", direction="forward", mb=0, layer=2, nbytes=100):
    return {
        "step": 2,
        "pass": "train",
        "kind": "a2a",
        "rank": rank,
        "start": start,
        "end": start + 0.1,
        "what": what,
        "direction": direction,
        "microbatch": mb,
        "layer": layer,
        "bytes": nbytes,
    }


def test_the_wait_for_the_other_ranks_call_and_the_busier_direction():
    """An all-to-all waits for the last rank's call: rank 0 calls a dispatch's two all-to-alls at 1.0 and
    1.2, rank 1 at 1.3 and 1.4, a combine both at 2.0: rank 0 waits 0.3 + 0.2, rank 1 nothing, 0.25 per
    rank. A dispatch of 100 bytes whose combine sends back 160 puts |160 - 100| / 2 = 30 more bytes on the
    busier direction than the mean."""
    from k2.launcher.benchmarks import ep_overlap_prediction as ep
    from k2.launcher.benchmarks import ep_overlap_trace as tr

    traces = {
        0: [_a2a(0, 1.0), _a2a(0, 1.2, nbytes=8), _a2a(0, 2.0, what="combine", nbytes=160)],
        1: [_a2a(1, 1.3), _a2a(1, 1.4, nbytes=8), _a2a(1, 2.0, what="combine", nbytes=40)],
    }
    assert tr.peer_wait(traces, 2) == pytest.approx(0.25)
    assert tr.a2a_nodes(traces[0], 2) == 2
    assert tr.a2a_excess(traces[0], 2) == pytest.approx(30) and tr.a2a_excess(traces[1], 2) == pytest.approx(30)
    # on a link of 1e-6 GB/s (1,000 bytes/s) those 30 bytes add 30 ms to the calibration's compute skew
    assert ep.peer_wait_us({"compute_skew_us": 500.0, "a2a_excess_bytes": 30.0}, 1e-6) == pytest.approx(30500.0)


def test_the_bench_writes_its_results_file_and_nothing_while_unfinished(tmp_path):
    """The results file is the bench's own record (command, commit, machine, options, figures with the raw
    timings), and appears whole or not at all: a record that cannot be written leaves no file."""
    import json

    from k2.launcher.benchmarks import ep_overlap as eo

    o = {**eo._DEFAULTS, "results_dir": str(tmp_path)}
    figures = {"cases": [{"speedup": 1.4, "raw": {"off_runs": [{"step_s": [2.0, 2.1]}]}}], "all_goals_met": True}
    path = eo.write_record(o, figures)
    record = json.loads(path.read_text())
    assert path.parent == tmp_path and path.name.startswith("ep_overlap_") and path.suffix == ".json"
    assert record["bench"] == "ep_overlap" and record["figures"] == figures and "results_dir" not in record["options"]
    assert record["system"]["cpu"] and record["command"] and record["utc"]
    with pytest.raises(TypeError):
        eo.write_record({**o, "results_dir": str(tmp_path / "bad")}, {"x": object()})
    assert list((tmp_path / "bad").iterdir()) == []
    assert eo.write_record({**o, "results_dir": "none"}, figures) is None


@pytest.mark.slow
def test_the_link_probe_measures_the_all_to_all_beside_compute(tmp_path):
    """The link probe's figures on two local processes over loopback (no namespaces, no shaping): every figure
    k2-plan's profile takes, the all-to-all's slowdown beside the host's compute at least 1."""
    from k2.launcher.benchmarks.shaped_link import ShapedLink, measure_link
    from k2.parallel.processes import free_port

    class Loopback(ShapedLink):
        def prefix(self, node):
            return []

        def rank_env(self, node, port):
            return {
                "RANK": str(node),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
            }

    r = measure_link(Loopback(), repeats=2, alltoall_bytes=1 << 16, port=free_port())
    assert set(r) == {
        "alltoall_gbps",
        "collective_gbps",
        "latency_us",
        "host_cpu_share",
        "loaded_latency_us",
        "beside_compute_slowdown",
    }
    assert r["beside_compute_slowdown"] >= 1 and r["latency_us"] > 0 and r["loaded_latency_us"] >= r["latency_us"]
