"""``k2-plan``'s prediction of ``pipeline.ep_overlap`` for one configuration, both settings side by side: what
``k2-bench bench=ep_overlap`` compares with its measured steps on a shaped link (the step-time model of
:mod:`k2.launcher.planning.step_time`, the overlap's rules in :mod:`k2.launcher.planning.ep_overlap`).

A shaped link as a profile (``plan.hardware`` file): the bench's measured machine profile with
``gpus_per_host: 1`` (one rank per "node", so every all-to-all and collective crosses the link),
``network_alltoall_gbps`` / ``network_collective_gbps`` / ``network_gbps`` (and the same ``nvlink_*``: no
rank has a neighbour on its node) the link's measured gloo all-to-all / all-reduce rates, or, without a
measurement, :func:`tbf_goodput_gbps` of the ``tc tbf`` rate; ``network_latency_us`` /
``intra_latency_us`` the link's measured small-message latency, ``network_loaded_latency_us`` the same
while all-to-alls are on the wire; ``comm_stream: host_thread`` (k2-train on CPU runs the communication
stream as a thread of the rank's process).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k2.config.schema import K2Config

#: TCP payload per Ethernet frame at MTU 1500 as ``tc tbf`` counts it on a veth: 1,448 bytes of data
#: (1,500 less 20 of IPv4, 20 of TCP and 12 of the timestamp option Linux sends by default) in
#: 1,514 bytes (the 14-byte Ethernet header is in the packet length tbf meters)
TCP_PAYLOAD_PER_FRAME = 1448 / 1514

_AFTER_PASS = ("dp_grad_reduce_scatter", "dp_param_all_gather", "optimizer", "muon_gather", "optimizer_offload")


def tbf_goodput_gbps(rate_mbit: float, payload_per_frame: float = TCP_PAYLOAD_PER_FRAME) -> float:
    """GB/s (1e9 bytes/s) of TCP payload through a ``tc tbf`` shaper of ``rate_mbit`` Mbit/s at MTU 1500:
    the rate over 8 bits times :data:`TCP_PAYLOAD_PER_FRAME`. An estimate for when the link is not
    measured; gloo's own framing and acknowledgements are not in it."""
    return rate_mbit * 1e6 / 8 * payload_per_frame / 1e9


def predict_ep_overlap(cfg: K2Config, profile: str | dict | None = None) -> dict[str, Any]:
    """The main phase's step with ``pipeline.ep_overlap`` off and on, for ``cfg`` on ``profile``.

    Args:
        cfg: a composed config (``k2.config.load_config``) describing the run and its cluster (the shaped
            link's bench: ``cluster.nodes=2 cluster.gpus_per_node=1``); its ``pipeline.ep_overlap`` is
            replaced by each setting.
        profile: a profile file's path, a profile mapping (the keys of a profile file; written to a
            temporary file), or None (``cfg.plan.hardware``).

    Returns:
        ``{"off": {...}, "on": {...}, "speedup": off / on step, "exposed_cut": 1 - on / off exposed
        all-to-all}``; per setting: ``step_s``, ``pass_s`` (the step less the DP traffic and optimizer
        after the pipeline), ``exposed_a2a_s`` (the busiest rank's exposed all-to-all seconds per step),
        ``ep_overlap`` (whether the overlap runs in that phase and layout), ``ep_overlap_note`` (why not),
        ``ep_comm`` (:func:`k2.launcher.planning.ep_overlap.ep_summary`: exposed and hidden by kind and,
        with the overlap, by part of the schedule), ``breakdown_s`` (every term; they sum to ``step_s``).

    Raises:
        ConfigError: a profile that is not one (naming ``plan.hardware``), a layout that does not fit the
            cluster.
    """
    import yaml
    from omegaconf import OmegaConf

    from k2.launcher.planning.cluster import plan_cluster

    path = None
    if isinstance(profile, dict):
        fd, path = tempfile.mkstemp(prefix="k2-profile-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(dict(profile), f)
    hardware = path or (str(profile) if profile is not None else str(cfg.plan.hardware))
    try:
        out: dict[str, Any] = {}
        for name, on in (("off", False), ("on", True)):
            c = OmegaConf.merge(cfg, {"pipeline": {"ep_overlap": on}, "plan": {"hardware": hardware, "search": False}})
            p = plan_cluster(c).report
            b = p["step_time_breakdown_s"]
            out[name] = {
                "step_s": p["step_time_s_estimated"],
                "pass_s": p["step_time_s_estimated"] - sum(b.get(k, 0.0) for k in _AFTER_PASS),
                "exposed_a2a_s": b["ep_comm"],
                "ep_overlap": p["ep_overlap"],
                "ep_overlap_note": p["ep_overlap_note"],
                "ep_comm": p["ep_comm_s"],
                "breakdown_s": b,
            }
    finally:
        if path is not None:
            os.unlink(path)
    off, on = out["off"], out["on"]
    out["speedup"] = off["step_s"] / on["step_s"]
    out["exposed_cut"] = 1 - on["exposed_a2a_s"] / off["exposed_a2a_s"] if off["exposed_a2a_s"] > 0 else 0.0
    return out
