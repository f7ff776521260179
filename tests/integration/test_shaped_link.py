"""The shaped link of ``k2-bench bench=ep_overlap`` (launcher/benchmarks/shaped_link.py) measured for real:
two network namespaces, a veth pair shaped with tc tbf, gloo between them. Needs root (skipped without)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
        reason="needs root, ip and tc to build network namespaces",
    ),
]


def test_a_small_all_gather_queues_behind_all_to_alls_on_a_shaped_link():
    """At 20 Mbit/s, all-to-alls of 64 KB per rank back to back from a communication thread keep ~16 KB
    (TCP's small-queue limit) in front of the shaper: a small all-gather on another process group then
    waits for it, ~6.5 ms per direction, where alone it takes well under a millisecond. The link's figures
    are what k2-plan's profile reads: the loaded latency, the all-to-all's rate (near 20 Mbit/s = 0.0025
    GB/s), the host's CPU share."""
    from k2.launcher.benchmarks.shaped_link import ShapedLink, measure_link

    with ShapedLink(9, rate_mbit=20.0) as link:
        f = measure_link(link, repeats=3, cwd=Path(__file__).resolve().parents[2], alltoall_bytes=1 << 16)
    assert 0.0015 < f["alltoall_gbps"] < 0.0026, f
    assert f["latency_us"] < 2000 and f["loaded_latency_us"] > f["latency_us"] + 2000, f
    assert 0 <= f["host_cpu_share"] < 1, f
