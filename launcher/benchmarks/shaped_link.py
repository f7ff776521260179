"""Two "nodes" on one machine joined by a shaped link: network namespaces and a veth pair whose both ends
are rate-limited with ``tc`` ``tbf``, so that communication between processes in the two namespaces costs
wall time on the wire while their CPUs are free -- what a cluster's network does, without a cluster.

Why this: gloo's collectives progress on gloo's own threads, so on a shaped link an all-to-all posted by
one thread runs while another computes, and the overlap of ``pipeline.ep_overlap`` becomes measurable on
CPU. The kernel's ``tbf`` queueing discipline drops every packet larger than its ``burst``: the veth MTU
is 1500 and the burst well above it.

Layout (addresses private to the namespaces this module creates; nothing leaves the machine)::

    netns k2ovl<i>-node0: <veth>a 10.232.<i>.1/24  <-- tbf rate R -->  <veth>b 10.232.<i>.2/24 :netns k2ovl<i>-node1

Needs root, ``ip`` (iproute2) and ``tc``; :func:`check_can_shape` says in one line what is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from k2.config.errors import ConfigError

__all__ = ["ShapedLink", "check_can_shape", "measure_link"]

#: bytes one TCP flow may queue in front of the link's shaper (``net.ipv4.tcp_limit_output_bytes``)
TCP_QUEUE_BYTES = 16384


def check_can_shape() -> None:
    """Raise ConfigError (one line) unless this process can create namespaces and shape a link."""
    missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
    if os.geteuid() != 0 or missing:
        why = "root" if os.geteuid() != 0 else "the " + " and ".join(missing) + " command" + ("s" * (len(missing) > 1))
        raise ConfigError(
            f"bench=ep_overlap needs {why} to put its two ranks in network namespaces joined by a "
            "veth pair shaped with tc tbf (iproute2); run it as root on Linux"
        )


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


class ShapedLink:
    """Two namespaces joined by one veth pair shaped at :attr:`rate_mbit` in each direction (a context
    manager: made on entry, removed on exit, also after an error).

    Args:
        number: picks the names and the subnet ``10.232.<number>.0/24`` (two benchmarks at once need two
            numbers).
        rate_mbit: the link rate in Mbit/s (1e6 bits per second), each direction; None = unshaped.
    """

    def __init__(self, number: int = 0, rate_mbit: float | None = None):
        self.number = int(number)
        self.netns = [f"k2ovl{self.number}-node{i}" for i in (0, 1)]
        self.dev = [f"k2ovl{self.number}a", f"k2ovl{self.number}b"]  # (interface names: <= 15 characters)
        self.addr = [f"10.232.{self.number}.1", f"10.232.{self.number}.2"]
        self.rate_mbit = rate_mbit

    def __enter__(self) -> ShapedLink:
        check_can_shape()
        self.remove()  # what an earlier run may have left
        try:
            for ns in self.netns:
                _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1]])
            for i in (0, 1):
                ns, dev = self.netns[i], self.dev[i]
                _run(["ip", "link", "set", dev, "netns", ns])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "mtu", "1500"])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                # TCP small queues: a flow may put at most this many bytes in front of the shaper (4 MB
                # by default), so flows interleave there as they do on a switch's ports and a small
                # message (megatron's token-count all-gather before each dispatch) does not wait for a
                # whole all-to-all queued ahead of it
                _run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "sysctl",
                        "-q",
                        "-w",
                        f"net.ipv4.tcp_limit_output_bytes={TCP_QUEUE_BYTES}",
                    ]
                )
            self.set_rate(self.rate_mbit)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def set_rate(self, rate_mbit: float | None) -> None:
        """Shape both directions at ``rate_mbit`` Mbit/s (None: no shaping). The token bucket holds 64 KB
        (about 40 full frames), and a packet waits at most 1 s in the queue before it is dropped (TCP
        then retransmits, which only happens if a burst overflows it)."""
        self.rate_mbit = rate_mbit
        for ns, dev in zip(self.netns, self.dev):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
            if rate_mbit is not None:
                _run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        f"{float(rate_mbit):.6g}mbit",
                        "burst",
                        "64kb",
                        "latency",
                        "1000ms",
                    ]
                )

    def remove(self) -> None:
        """Delete the namespaces (their veth ends go with them)."""
        for ns in self.netns:
            _run(["ip", "netns", "del", ns], check=False)
        _run(["ip", "link", "del", self.dev[0]], check=False)

    def prefix(self, node: int) -> list[str]:
        """The command prefix that runs a process on ``node`` (0 or 1)."""
        return ["ip", "netns", "exec", self.netns[node]]

    def rank_env(self, node: int, port: int) -> dict[str, str]:
        """Environment of the rank on ``node`` of a 2-rank gloo job whose rendezvous is on node 0."""
        return {
            "RANK": str(node),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": self.addr[0],
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": self.dev[node],
        }

    def run_pair(
        self, cmd: list[str], env: dict[str, str], cwd: Path, timeout: float, port: int = 29611
    ) -> list[subprocess.CompletedProcess]:
        """Run ``cmd`` as rank 0 on node 0 and rank 1 on node 1 at once; returns both results.

        Raises:
            RuntimeError: a rank failed or did not finish in ``timeout`` seconds (both are killed).
        """
        procs = [
            subprocess.Popen(
                [*self.prefix(i), *cmd],
                cwd=cwd,
                env={**env, **self.rank_env(i, port)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in (0, 1)
        ]
        deadline = time.time() + timeout
        out = []
        try:
            for p in procs:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.time()))
                out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{' '.join(cmd)} did not finish in {timeout:.0f} s on the shaped link") from None
        bad = [r for r in out if r.returncode != 0]
        if bad:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({bad[0].returncode}) on the shaped link:\n"
                f"{bad[0].stdout[-2000:]}\n{bad[0].stderr[-3000:]}"
            )
        return out


_PROBE = r"""
import json, os, resource, statistics, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
def best(fn, n):
    ts = []
    for _ in range(n):
        dist.barrier(); t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return min(ts)
res = {}
small, big = torch.ones(2), torch.ones(int(os.environ["K2_BYTES"]) // 4)  # half of big to the other rank
out = torch.empty_like(small)
best(lambda: dist.all_to_all_single(out, small), 2)
res["small"] = best(lambda: dist.all_to_all_single(out, small), int(os.environ["K2_REPEATS"]))
# the sustained rate: 16 all-to-alls back to back, as a step sends them (one alone passes partly on the
# shaper's token bucket and the sockets' buffers, faster than the link's rate)
out = torch.empty_like(big)
def burst():
    for _ in range(16):
        dist.all_to_all_single(out, big)
burst()
res["big"] = best(burst, max(1, int(os.environ["K2_REPEATS"]) // 2)) / 16
# the host's work on them, issued as k2-train issues them with the overlap on (from its communication
# thread): this process's CPU seconds (every thread's, user and kernel) per wall second
from k2.parallel.comm_stream import CommStream
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
stream = CommStream()
def streamed():
    for f in [stream.submit(dist.all_to_all_single, out, big) for _ in range(16)]:
        f.result()
streamed()
dist.barrier(); c, t = cpu(), time.perf_counter()
for _ in range(max(1, int(os.environ["K2_REPEATS"]) // 2)):
    streamed()
res["big_cpu_share"] = (cpu() - c) / (time.perf_counter() - t)
# the same all-to-alls from the communication thread while the main thread computes (GEMMs until they are
# done): how much longer they take on the wire beside the host's compute
a = torch.randn(256, 256)
def beside():
    f = stream.submit(burst)
    while not f.done():
        a @ a
    f.result()
beside()
res["big_beside_compute"] = best(beside, max(1, int(os.environ["K2_REPEATS"]) // 2)) / 16
# a small all-gather (megatron's token counts before each dispatch: 8 int64 per rank, its own process
# group, from the main thread) while all-to-alls are on the wire: it queues behind their bytes
group = dist.new_group([0, 1])
counts, gathered = torch.ones(8, dtype=torch.int64), torch.empty(16, dtype=torch.int64)
def gather():
    t = time.perf_counter(); dist.all_gather_into_tensor(gathered, counts, group=group)
    return time.perf_counter() - t
res["small_gather"] = best(gather, int(os.environ["K2_REPEATS"]))
n = torch.tensor([min(8000, int(0.6 / max(res["big"], 1e-5)) + 20)])
dist.broadcast(n, 0)  # (both ranks issue as many)
def pump():
    for _ in range(int(n)):
        dist.all_to_all_single(out, big)
dist.barrier()
f, loaded = stream.submit(pump), []
for _ in range(60):
    x = gather()
    if not f.done():
        loaded.append(x)
    time.sleep(0.001)
f.result()
res["loaded_gather"] = statistics.median(loaded) if loaded else res["small_gather"]
stream.close()
y = torch.ones(1 << 18)
best(lambda: dist.all_reduce(y), 1)
res["all_reduce_1mib"] = best(lambda: dist.all_reduce(y), int(os.environ["K2_REPEATS"]))
if dist.get_rank() == 0:
    print("K2PROBE " + json.dumps(res))
dist.destroy_process_group()
"""


def measure_link(
    link: ShapedLink, repeats: int = 5, cwd: Path | None = None, alltoall_bytes: int = 1 << 20, port: int = 29612
) -> dict[str, float]:
    """gloo's all-to-all and all-reduce between the two nodes, as the step-time model reads them.

    Args:
        alltoall_bytes: bytes each rank puts into the measured all-to-all (half of them go to the other
            rank): a run's own message size, since tbf's token bucket lets short messages through faster
            than its rate.
        port: the rendezvous port on node 0.

    Returns:
        ``alltoall_gbps`` (GB/s each rank sends to the other, 1e9 bytes: the all-to-all's remote half over its
        time less the latency, sustained over 16 back to back), ``collective_gbps`` (ring bus bandwidth of a 1
        MiB all-reduce: 2 (n - 1) / n of the buffer per rank), ``latency_us`` (a 2-element all-to-all),
        ``host_cpu_share`` (the CPU seconds rank 0's process spends, in all its threads and the kernel, per
        wall second of those back-to-back all-to-alls: the share of a core the link's all-to-all takes from
        the compute beside it, k2-plan's ``alltoall_host_cpu_share``), ``loaded_latency_us`` (``latency_us``
        plus what a small all-gather on another process group takes longer, median, while all-to-alls of
        that size run back to back from a communication thread: k2-plan's ``network_loaded_latency_us``),
        ``beside_compute_slowdown`` (those back-to-back all-to-alls' time less the latency, from the
        communication thread while the main thread runs GEMMs, over the same alone; at least 1: k2-plan's
        ``alltoall_beside_compute_slowdown``).
    """
    alltoall_bytes = max(8, int(alltoall_bytes) // 8 * 8)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K2_REPEATS": str(repeats), "K2_BYTES": str(alltoall_bytes)}
    res = link.run_pair([sys.executable, "-c", _PROBE], env, cwd or Path.cwd(), timeout=300, port=port)
    line = [ln for ln in res[0].stdout.splitlines() if ln.startswith("K2PROBE ")][0]
    import json

    r = json.loads(line[len("K2PROBE ") :])
    lat = r["small"]
    remote = alltoall_bytes / 2
    return {
        "alltoall_gbps": remote / max(r["big"] - lat, 1e-9) / 1e9,
        "collective_gbps": (1 << 20) * 2 * (2 - 1) / 2 / max(r["all_reduce_1mib"] - lat, 1e-9) / 1e9,
        "latency_us": lat * 1e6,
        "host_cpu_share": r["big_cpu_share"],
        "loaded_latency_us": max(lat, lat + r["loaded_gather"] - r["small_gather"]) * 1e6,
        "beside_compute_slowdown": max(1.0, (r["big_beside_compute"] - lat) / max(r["big"] - lat, 1e-9)),
    }
