"""k2-plan's side of ``k2-bench bench=ep_overlap`` (:mod:`k2.launcher.benchmarks.ep_overlap`): the benchmarked
model's settings, this machine's profile with the shaped link as its network (the link's measured figures:
rates, latencies, the host's share of a core per all-to-all, the wait for the other rank), that profile's
compute calibrated by an unshaped overlap-off run (``compute_scale``), and k2-plan's step with the overlap off
and on predicted on it.

**The wait for the other rank** (``alltoall_peer_wait_us``). An all-to-all moves nothing until both ranks
have called it. In the trainer's trace the ranks call each dispatch and combine apart by 1-4 ms
(``peer_wait_off_us`` / ``peer_wait_on_us``: the mean over the ranks of the latest call less the own, per
dispatch or combine): the ranks' compute between two all-to-alls differs (the tokens routed to each rank's
experts, the host's noise), and on a shaped link the rank that receives more finishes an all-to-all later
(routing sends the two directions different byte counts: the busier one carries ``|C - D| / 2`` more than
their mean, ``D`` the bytes of a forward dispatch, ``C`` of its combine). The profile's wait per dispatch or
combine on a rate's link is the rate's unshaped calibration run's, measured in its trace: its wait less
what its busier direction took on the unshaped link (the compute skew) plus the busier direction's extra
bytes over this link's rate. A replay of the traced runs (:mod:`k2.launcher.benchmarks.ep_overlap_replay`)
without these waits halves their exposed all-to-all with the overlap on.

"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from k2.config.load import load_config


def model_settings(o: dict) -> list[str]:
    """The settings of the benchmarked model and layout (the runs' and the prediction's)."""
    return [
        f"model={o['model']}",
        "parallel=single",
        "parallel.ep=2",
        f"model.num_layers={o['num_layers']}",
        f"model.moe_ffn_hidden_size={o['moe_ffn_hidden_size']}",
        f"train.micro_batch_size={o['micro_batch_size']}",
        f"schedule.global_batch_tokens={o['global_batch_tokens']}",
        f"pipeline.decouple_wgrad={str(o['decouple_wgrad']).lower()}",
    ]


def write_link_profile(link_figures: dict, device: dict, path: Path) -> str:
    """:func:`link_profile` written to ``path`` (a profile file); returns the path."""
    from k2.launcher.benchmarks.hardware import write_profile

    write_profile(link_profile(link_figures, device), str(path))
    return str(path)


def link_profile(link_figures: dict, device: dict) -> dict:
    """This machine's profile with the shaped link as the network between two one-rank nodes (the keys of a
    profile file)."""
    prof = dict(device)
    rate = link_figures["rate_mbit"]
    prof.update(
        name=f"measured-shaped-link-{rate:g}mbit" if rate else "measured-unshaped-link",
        gpus_per_host=1,
        network_latency_us=link_figures["latency_us"],
        intra_latency_us=link_figures["latency_us"],
        comm_stream="host_thread",  # (k2-train's CPU communication stream: k2.parallel.comm_stream)
        alltoall_host_cpu_share=min(link_figures["host_cpu_share"], 0.95),
        # (measure_link's loaded latency is never below its latency; a mapping without one: no queue)
        network_loaded_latency_us=link_figures.get("loaded_latency_us", link_figures["latency_us"]),
        alltoall_beside_compute_slowdown=link_figures.get("beside_compute_slowdown", 1.0),
        alltoall_peer_wait_us=link_figures.get("peer_wait_us", 0.0),
    )
    for side in ("nvlink", "network"):  # (one rank per node: every collective crosses the link)
        prof.update(
            {
                f"{side}_gbps": link_figures["alltoall_gbps"],
                f"{side}_alltoall_gbps": link_figures["alltoall_gbps"],
                f"{side}_collective_gbps": link_figures["collective_gbps"],
            }
        )
    prof.setdefault("sources", {})["shaped_link"] = (
        "k2-bench bench=ep_overlap: gloo between two network namespaces over a veth pair "
        + (f"shaped with tc tbf at {rate:g} Mbit/s" if rate else "(not shaped)")
        + " (the run's all-to-all size, 16 back to back, alone and beside a GEMM loop, and the process's CPU "
        "seconds per wall second of them; all-reduce of 1 MiB)"
    )
    return prof


def predicted(o: dict, profile: str) -> dict[str, Any]:
    """k2-plan's step with the overlap off and on for the benchmarked run on ``profile``
    (:func:`k2.launcher.planning.overlap_prediction.predict_ep_overlap`)."""
    from k2.launcher.planning import predict_ep_overlap

    return predict_ep_overlap(load_config([*model_settings(o), "cluster.nodes=2", "cluster.gpus_per_node=1"]), profile)


def peer_wait_us(unshaped_link: dict, alltoall_gbps: float) -> float:
    """The profile's ``alltoall_peer_wait_us`` on a link of ``alltoall_gbps``: the calibration run's compute
    skew per dispatch or combine plus the busier direction's extra bytes over the link's rate (both from
    the unshaped overlap-off calibration run: :func:`k2.launcher.benchmarks.ep_overlap._unshaped_run`)."""
    return unshaped_link["compute_skew_us"] + unshaped_link["a2a_excess_bytes"] / (alltoall_gbps * 1e9) * 1e6


#: the step-time terms of compute on the rank (they scale with its speed); the rest is communication
COMPUTE_TERMS = ("gemm", "attention", "non_gemm", "schedule", "recompute", "optimizer", "host")
#: the profile's figures of the rank's speed: rates (divided by the compute scale) and costs (multiplied)
RATE_KEYS = (
    "gemm_fp32_tflops",
    "gemm_bf16_tflops",
    "gemm_fp8_tflops",
    "gemm_grouped_bf16_tflops",
    "gemm_grouped_fp8_tflops",
    "gemm_ceiling_tflops",
    "attention_tflops",
    "memory_gbps",
    "peak_bf16_tflops",
    "peak_fp8_tflops",
)
#: per-operator and per-step costs, multiplied by the compute scale (the host's time per operator too: a
#: slower machine issues them slower, and the step-time model's host term takes max(host, GPU))
COST_KEYS = (
    "kernel_launch_us",
    "microbatch_overhead_us",
    "step_overhead_us",
    "host_forward_operator_us",
    "host_backward_operator_us",
)


def calibrated(device: dict, scale: float) -> dict:
    """``device`` with its compute ``scale`` times slower: its rates divided and its per-operator costs
    (``kernel_launch_us``, ``operator_us``, the schedule's overheads) multiplied by ``scale``; its links
    untouched."""
    out = dict(device)
    for k in RATE_KEYS:
        if out.get(k):
            out[k] = out[k] / scale
    for k in COST_KEYS:
        if out.get(k):
            out[k] = out[k] * scale
    out["operator_us"] = {k: v * scale for k, v in (device.get("operator_us") or {}).items()}
    return out


def unshaped_case(o: dict, unshaped: dict, device: dict, tmp: Path) -> dict[str, float]:
    """The calibration run (overlap off, link not shaped) against its prediction: how far the model's
    compute is from this run's where the link costs little; and ``compute_scale``, the factor on the
    profile's compute (:func:`calibrated`) at which the model's step equals this run's (the
    communication terms kept): ``(measured step - communication) / compute``."""
    step = statistics.median(unshaped["run"]["step_s"])
    tmp.mkdir(parents=True, exist_ok=True)
    p = predicted(o, write_link_profile(unshaped["link"], device, tmp / "profile-unshaped.yaml"))["off"]
    compute = sum(p["breakdown_s"].get(k, 0.0) for k in COMPUTE_TERMS)
    scale = max(step - (p["step_s"] - compute), 1e-9) / compute if compute > 0 else 1.0
    return {
        "unshaped_step_off_s": step,
        "unshaped_predicted_off_s": p["step_s"],
        "unshaped_predicted_over_measured_off": p["step_s"] / step,
        "compute_scale": scale,
    }
