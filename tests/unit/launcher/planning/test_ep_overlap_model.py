"""k2-plan's model of pipeline.ep_overlap (launcher/planning/ep_overlap.py): one combined-1F1B step on a
compute and a communication stream, against timelines worked out by hand, on both of the profile's
semantics (a GPU's second stream, k2-train's CPU thread), and what the step-time model makes of it for
K2 (the overlap hides most of the all-to-all; dropping it puts the 196 s step back). Pure Python."""

from __future__ import annotations

import pytest

from k2.config.errors import ConfigError
from k2.launcher.planning import ep_overlap as eo
from k2.launcher.planning.hardware import load_profile, profile_from_dict


def _layer(wire: float, combine_compute: float = 0.0) -> dict:
    """One MoE layer's nodes: attention 4 / 5 (+1 W), experts 4 / 5 (+2 W), every all-to-all ``wire``."""
    return {
        "attn": {"F": {"gemm": 4.0}, "B": {"gemm": 5.0}, "W": {"gemm": 1.0}},
        "dispatch": {"F": {"ep_comm": wire}, "B": {"ep_comm": wire}, "W": {}},
        "mlp": {"F": {"gemm": 4.0}, "B": {"gemm": 5.0}, "W": {"gemm": 2.0}},
        "combine": {"F": {"ep_comm": wire, "non_gemm": combine_compute}, "B": {"ep_comm": wire}, "W": {}},
    }


def _stage(*layers) -> eo.StagePlan:
    return eo.StagePlan(list(layers), {"F": {}}, {"F": {}}, {"B": {}, "W": {}}, {"B": {}, "W": {}})


def _pair(stream: str, wire: float, combine_compute: float = 0.0, decouple: bool = True) -> eo.StepCost:
    costs = eo.OverlapCosts([_stage(_layer(wire, combine_compute))], stream, decouple)
    return costs.pair(0, 0)


@pytest.mark.parametrize("stream", [eo.DEVICE, eo.HOST_THREAD])
def test_all_to_all_fully_hidden(stream):
    """All-to-alls of 2 under 21 of compute. By hand (GPU; the CPU thread issues the forward's dispatch
    after its attention and the backward's after its expert backward, so the same): combine_bwd 0-2 |
    attn_f 0-4 | mlp_b 4-9 | dispatch_f 4-6 | mlp_dw 9-11 | dispatch_b 9-11 | mlp_f 11-15 | combine_f 15-17 |
    attn_b 15-20 | attn_dw 20-21: nothing exposed, the step is its compute."""
    c = _pair(stream, 2.0)
    assert c.seconds == pytest.approx(21.0)
    assert c.terms["ep_comm"] == 0 and sum(c.terms.values()) == pytest.approx(c.seconds)
    assert c.wire["dispatch_fwd"] == c.wire["combine_bwd"] == 2.0


@pytest.mark.parametrize("stream", [eo.DEVICE, eo.HOST_THREAD])
def test_all_to_all_partly_exposed(stream):
    """All-to-alls of 5: combine_bwd 0-5 while attn_f runs 0-4, so mlp_b waits 4-5 (1 s of combine_bwd
    exposed); dispatch_f 5-10 under mlp_b 5-10, dispatch_b 10-15 under mlp_dw 10-12 + mlp_f 12-16,
    combine_f 16-21 under attn_b 16-21: the step is 22 s (21 of compute + 1)."""
    c = _pair(stream, 5.0)
    assert c.seconds == pytest.approx(22.0)
    assert c.exposed["combine_bwd"] == pytest.approx(1.0) and c.terms["ep_comm"] == pytest.approx(1.0)
    assert sum(c.exposed.values()) == pytest.approx(1.0)


def test_communication_thread_compute_takes_the_cpu():
    """The combine's un-permutation (1 s) after combine_f's wire (16-21): on a GPU its stream runs it
    21-22 beside attn_dw (21-22), hidden; on k2-train's CPU thread it takes the CPU from attn_dw, which
    ends at 23, and the second counts as non-GEMM time."""
    gpu, cpu = _pair(eo.DEVICE, 5.0, 1.0), _pair(eo.HOST_THREAD, 5.0, 1.0)
    assert gpu.seconds == pytest.approx(22.0)
    assert cpu.seconds == pytest.approx(23.0) and cpu.terms["non_gemm"] == pytest.approx(1.0)
    assert sum(cpu.terms.values()) == pytest.approx(cpu.seconds)


def test_an_all_to_alls_host_work_takes_the_cpu_beside_it():
    """All-to-alls of 2 with half of a core busy on each while on the wire (``alltoall_host_cpu_share``
    0.5). By hand on k2-train's CPU thread: combine_bwd 0-2 beside attn_f (4 s of work: 1 done by 2, ends
    5), dispatch_f 5-7 beside mlp_b (ends 11), dispatch_b 11-13 beside mlp_dw (ends 14), mlp_f 14-18,
    combine_f 18-20 beside attn_b (ends 24), attn_dw 24-25: 25 s, 1 s per all-to-all as ``ep_comm_host``,
    nothing exposed."""
    cpu = eo.OverlapCosts([_stage(_layer(2.0))], eo.HOST_THREAD, True, comm_share=0.5).pair(0, 0)
    assert cpu.seconds == pytest.approx(25.0)
    assert cpu.terms["ep_comm_host"] == pytest.approx(4.0) and cpu.terms["ep_comm"] == 0
    assert "ep_comm_sms" not in cpu.terms
    assert sum(cpu.terms.values()) == pytest.approx(cpu.seconds)


def test_an_all_to_alls_sms_slow_the_compute_beside_it_on_a_gpu():
    """All-to-alls of 2 whose kernel occupies a quarter of the SMs (33 of 132) while on the wire. By hand on a
    GPU's two streams: combine_bwd 0-2 beside attn_f (4 s: 1.5 done by 2, ends 4.5), mlp_b 4.5-10 with
    dispatch_f 4.5-6.5 beside it (it is issued after mlp_b, but its stream starts it once attn_f is done),
    dispatch_b 10-12 beside mlp_dw 10-12.5, mlp_f 12.5-16.5, combine_f 16.5-18.5 beside attn_b 16.5-22,
    attn_dw 22-23: 23 s; each all-to-all costs the compute a quarter of its 2 s (``ep_comm_sms`` 2), nothing
    exposed. Without the SM share: 21 s."""

    def pair(share):
        return eo.OverlapCosts([_stage(_layer(2.0))], eo.DEVICE, True, comm_share=share).pair(0, 0)

    gpu, free = pair(33 / 132), pair(0.0)
    assert (gpu.seconds, free.seconds) == pytest.approx((23.0, 21.0))
    assert gpu.terms["ep_comm_sms"] == pytest.approx(4 * 2.0 * 0.25) and gpu.terms["ep_comm"] == 0
    assert sum(gpu.terms.values()) == pytest.approx(gpu.seconds)
    assert gpu.compute == free.compute  # (the stolen seconds are not the compute stream's own work)


def test_the_token_count_all_gather_waits_behind_an_all_to_all_on_the_wire():
    """The dispatcher's token-count all-gather ends the forward's attention node (``ep_token_counts``: 0.5
    of its 4 s). Queued behind combine_bwd (on the wire 0-4.5) it waits 1 s longer (``counts_queue_s``):
    attn_f 0-5, so mlp_b starts at 5 instead of waiting 4-4.5 for the combine, and everything after moves
    by 0.5: 22 s against 21.5, the combine's exposed 0.5 s now the all-gather's wait. A forward alone has
    nothing on the wire when its all-gather runs (its own dispatch comes after): no wait."""
    layer = _layer(4.5)
    layer["attn"]["F"] = {"gemm": 3.5, "ep_token_counts": 0.5}
    costs = {q: eo.OverlapCosts([_stage(layer)], eo.DEVICE, True, counts_queue_s=q) for q in (0.0, 1.0)}
    plain, queued = costs[0.0].pair(0, 0), costs[1.0].pair(0, 0)
    assert (plain.seconds, queued.seconds) == pytest.approx((21.5, 22.0))
    assert (plain.terms["ep_token_counts"], queued.terms["ep_token_counts"]) == pytest.approx((0.5, 1.5))
    assert (plain.exposed["combine_bwd"], queued.exposed["combine_bwd"]) == pytest.approx((0.5, 0.0))
    assert sum(queued.terms.values()) == pytest.approx(queued.seconds)
    assert queued.compute["ep_token_counts"] == pytest.approx(0.5)  # (the wait is not the stream's work)
    assert costs[1.0].forward(0).terms["ep_token_counts"] == pytest.approx(0.5)


def test_decoupled_weight_gradients_hide_more():
    """Without the split, mlp_b carries its W (7 s): dispatch_b starts at 12 and attn_b waits for it
    until 17; with the split it starts at 10 and mlp_dw covers it."""
    joint, split = _pair(eo.DEVICE, 5.0, decouple=False), _pair(eo.DEVICE, 5.0, decouple=True)
    assert split.seconds < joint.seconds
    assert joint.exposed["dispatch_bwd"] > 0 == split.exposed["dispatch_bwd"]


@pytest.mark.parametrize("stream", [eo.DEVICE, eo.HOST_THREAD])
def test_one_microbatch_alone_exposes_its_all_to_alls(stream):
    """A warm-up forward alone: its chain of nodes, every all-to-all exposed (4 + 5 + 4 + 5 = 18)."""
    costs = eo.OverlapCosts([_stage(_layer(5.0))], stream, True)
    f = costs.forward(0)
    assert f.seconds == pytest.approx(18.0)
    assert f.exposed["dispatch_fwd"] == f.exposed["combine_fwd"] == pytest.approx(5.0)


def test_profile_comm_stream_setting():
    """A profile says how its communication stream runs; another value is one clear error."""
    assert load_profile("h800").comm_stream == eo.DEVICE
    d = load_profile("h800").as_dict()
    assert profile_from_dict({**d, "comm_stream": "host_thread"}, "x").comm_stream == eo.HOST_THREAD
    with pytest.raises(ConfigError, match="comm_stream.*allowed: device, host_thread"):
        profile_from_dict({**d, "comm_stream": "thread"}, "x.yaml")


def test_prediction_for_a_shaped_link():
    """What k2-bench bench=ep_overlap calls: the main phase with the overlap off and on, from a profile
    mapping (PP1 x EP2, one rank per node, the CPU's thread semantics, a link of tbf's goodput at 100 Mbit/s).
    The overlap runs, hides part of the all-to-all (what it cannot hide: the warm-up forward's and the
    cool-down backward's) and shortens the step; the bench's figures are there."""
    from k2.config import load_config
    from k2.launcher.planning.overlap_prediction import TCP_PAYLOAD_PER_FRAME, predict_ep_overlap, tbf_goodput_gbps

    assert tbf_goodput_gbps(100.0) == pytest.approx(12.5e-3 * 1448 / 1514) and TCP_PAYLOAD_PER_FRAME < 1
    link = tbf_goodput_gbps(100.0)
    prof = {
        **load_profile("h200").as_dict(),
        "gpus_per_host": 1,
        "kernel_launch_us": 30.0,
        "nongemm_share": 0.0,
        "gemm_fp32_tflops": 0.1,
        "attention_tflops": 0.1,
        "memory_gbps": 10.0,
        "gemm_tile": 1,
        "compute_units": None,
        "comm_stream": "host_thread",
        "network_latency_us": 300.0,
        **{
            f"{side}_{kind}": link
            for side in ("nvlink", "network")
            for kind in ("gbps", "alltoall_gbps", "collective_gbps")
        },
    }
    cfg = load_config(
        [
            "model=k2_tiny",
            "parallel=single",
            "parallel.ep=2",
            "pipeline.decouple_wgrad=true",
            "cluster.nodes=2",
            "cluster.gpus_per_node=1",
        ]
    )
    r = predict_ep_overlap(cfg, prof)
    off, on = r["off"], r["on"]
    assert on["ep_overlap"] and not off["ep_overlap"]
    assert off["exposed_a2a_s"] == pytest.approx(off["ep_comm"]["total_s"]) and off["exposed_a2a_s"] > 0
    assert 0 < on["exposed_a2a_s"] < off["exposed_a2a_s"] and on["step_s"] < off["step_s"]
    assert on["ep_comm"]["by_part"]["warmup"] > 0 and on["ep_comm"]["by_part"]["cooldown"] > 0
    assert r["speedup"] == pytest.approx(off["step_s"] / on["step_s"]) and 0 < r["exposed_cut"] < 1
    assert sum(on["breakdown_s"].values()) == pytest.approx(on["step_s"]) and on["pass_s"] < on["step_s"]
    # the link's host work (a tenth of a core while an all-to-all is on the wire) slows the compute beside
    # the overlapped all-to-alls; without the overlap it is inside the all-to-all's own (measured) time.
    # This step waits for the link: the slower compute fills time it waited anyway (exposed less by as much)
    busy = predict_ep_overlap(cfg, {**prof, "alltoall_host_cpu_share": 0.1})
    assert busy["off"]["step_s"] == pytest.approx(off["step_s"])
    host = busy["on"]["breakdown_s"]["ep_comm_host"]
    assert 0 < host <= 0.1 * on["ep_comm"]["total_s"] and on["breakdown_s"].get("ep_comm_host", 0.0) == 0
    assert busy["on"]["exposed_a2a_s"] == pytest.approx(on["exposed_a2a_s"] - host)
    assert busy["on"]["step_s"] == pytest.approx(on["step_s"])


def test_an_all_to_all_beside_the_hosts_compute_takes_longer_on_the_wire():
    """All-to-alls of 3 that take twice as long on the wire while the host computes (``wire_slowdown`` 2: the
    profile's ``alltoall_beside_compute_slowdown``). By hand on k2-train's CPU thread, settled: combine_bwd
    0-5 (half speed beside attn_f 0-4, then full), so mlp_b waits 4-5; dispatch_f 5-11 (half beside mlp_b
    5-10 and mlp_dw 10-12); dispatch_b 11-16.5 (half beside mlp_dw and mlp_f 12-16, full 16-16.5), so attn_b
    waits 16-16.5; combine_f 16.5-22.5 beside attn_b 16.5-21.5 and attn_dw 21.5-22.5: 22.5 s, 1.5 s
    exposed. At full speed all of it hides (21 s)."""

    def pair(slowdown):
        return eo.OverlapCosts([_stage(_layer(3.0))], eo.HOST_THREAD, True, wire_slowdown=slowdown).pair(0, 0)

    slow, fast = pair(2.0), pair(1.0)
    assert (slow.seconds, fast.seconds) == pytest.approx((22.5, 21.0))
    assert slow.exposed["combine_bwd"] == pytest.approx(1.0) and slow.exposed["dispatch_bwd"] == pytest.approx(0.5)
    assert slow.terms["ep_comm"] == pytest.approx(1.5) and fast.terms["ep_comm"] == 0
    assert slow.wire["dispatch_bwd"] == pytest.approx(5.5) and fast.wire["dispatch_bwd"] == pytest.approx(3.0)
    assert sum(slow.terms.values()) == pytest.approx(slow.seconds)


def test_each_all_to_all_waits_for_the_other_ranks_call():
    """The profile's ``alltoall_peer_wait_us`` (an all-to-all starts when the last rank of its group calls
    it) lengthens every dispatch and combine by as much, with the overlap or without: k2_tiny's 3 MoE
    layers x 4 all-to-alls x 4 microbatches per DP rank (4,096 tokens, DP 2, 4 x 128 each) = 48 per step,
    so 1 ms each is 48 ms more all-to-all per step, all of it exposed without the overlap. A negative wait
    is refused in one line."""
    from k2.config import load_config
    from k2.launcher.planning.overlap_prediction import predict_ep_overlap

    prof = {**load_profile("h200").as_dict(), "gpus_per_host": 1, "comm_stream": "host_thread"}
    cfg = load_config(
        [
            "model=k2_tiny",
            "parallel=single",
            "parallel.ep=2",
            "cluster.nodes=2",
            "cluster.gpus_per_node=1",
            "train.micro_batch_size=4",
            "schedule.global_batch_tokens=4096",
        ]
    )
    base, waiting = predict_ep_overlap(cfg, prof), predict_ep_overlap(cfg, {**prof, "alltoall_peer_wait_us": 1000.0})
    count = round((waiting["off"]["ep_comm"]["total_s"] - base["off"]["ep_comm"]["total_s"]) / 1e-3)
    assert count == 4 * 3 * 4
    assert waiting["off"]["exposed_a2a_s"] - base["off"]["exposed_a2a_s"] == pytest.approx(count * 1e-3)
    assert waiting["on"]["ep_comm"]["total_s"] - base["on"]["ep_comm"]["total_s"] == pytest.approx(count * 1e-3)
    with pytest.raises(ConfigError, match="alltoall_peer_wait_us"):
        profile_from_dict({**prof, "alltoall_peer_wait_us": -1.0}, "test")
