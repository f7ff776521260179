"""A real two-node Slurm cluster on one machine, for tests and by hand (Debian's slurm-wlm 22.05, as root).

Layout of cluster number 0 (every address is private to namespaces this module creates; nothing leaves
the machine)::

    this machine (head): slurmctld, munged, the test      bridge k2slurm0-br  10.223.23.1/24
      |-- veth -- netns k2slurm0-k2node1 (UTS hostname k2node1): slurmd -N k2node1, port 26838, 10.223.23.11
      |-- veth -- netns k2slurm0-k2node2 (UTS hostname k2node2): slurmd -N k2node2, port 26839, 10.223.23.12

Cluster number ``i`` has its own bridge, namespaces (``k2slurm<i>-...``), subnet (10.223.<23 + i>.0/24)
and slurmctld port (26837 + 10 i); a test takes the first number no other test process on this machine
holds (``TwoNodeSlurm(root)``: :func:`support.slurm_local.claim_slot`), so that test files on different
xdist workers, and the suites of other checkouts, each run a cluster of their own at the same time.

Each node is a network namespace (its own interfaces, addresses and ports: ranks on one node reach the
other only over the veth link) joined to the bridge, with its own hostname (a UTS namespace entered by
``unshare --uts``), its own slurmd (``-N``: its own spool, log, pid file and port) and its own
``/etc/hosts`` (``/etc/netns/<netns>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``) naming
the head and both nodes. The file system is shared, as on a cluster with a shared ``run.dir``. One
slurmctld runs on the head. munged is this cluster's own (its own socket, the system key; slurm.conf's
``AuthInfo=socket=``), so another test cluster starting or stopping the system munged does not touch it.

By hand::

    python tests/support/slurm_two_nodes.py start /tmp/k2two    # the first free number; prints the SLURM_CONF
    SLURM_CONF=/tmp/k2two/slurm.conf sinfo -N                     # k2node1, k2node2: idle
    python tests/support/slurm_two_nodes.py stop /tmp/k2two     # daemons, ranks, namespaces, bridge: gone

:class:`TwoNodeSlurm` ``start`` raises :class:`NamespacesRefused` when the kernel refuses a network
namespace or a veth pair (the only case the tests skip), :class:`SlurmUnavailable` for anything else.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (by hand): import the sibling module
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.slurm_local import (
    BASE_CONF,
    LocalSlurm,
    SlurmUnavailable,
    alive,
    claim_slot,
    ensure_installed,
    port_free,
    release_slot,
)

NODES = ("k2node1", "k2node2")
#: cluster number i's slurmctld port is CTLD_PORT + 10 i (on the head, beside the one-node clusters' ports)
CTLD_PORT = 26837
#: the slurmd ports (each in its node's own network namespace)
SLURMD_PORTS = {n: 26838 + i for i, n in enumerate(NODES)}
#: seconds without an answer from a node's slurmd before slurmctld marks the node DOWN (and requeues
#: its jobs): short, so that the lost-node test is quick; long enough for a loaded 2-core machine
SLURMD_TIMEOUT_S = 20
#: seconds between the SIGTERM and the SIGKILL slurmstepd sends a job's tasks when it is killed (enough
#: for the ranks to finish the step in progress and save it on a loaded machine)
KILL_WAIT_S = 30


class NamespacesRefused(SlurmUnavailable):
    """The kernel (or the container) refuses network namespaces or veth pairs."""


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


def _must(cmd, error=SlurmUnavailable) -> None:
    p = _run(cmd)
    if p.returncode != 0:
        raise error(f"{' '.join(cmd)} failed: {p.stderr.strip()}")


def _kill_and_wait(pids, timeout: float = 20, first: int = signal.SIGTERM) -> None:
    """Send ``first`` to ``pids``, then SIGKILL what is left after ``timeout`` seconds; returns when all
    are gone."""
    for pid in pids:
        try:
            os.kill(pid, first)
        except OSError:
            pass
    deadline = time.time() + timeout
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    while any(alive(p) for p in pids) and time.time() < deadline + 10:
        time.sleep(0.1)


class TwoNodeSlurm(LocalSlurm):
    """Two Slurm nodes (:data:`NODES`) in network namespaces of this machine, one partition ``two``;
    state under ``root``; ``number`` picks the bridge, namespaces, subnet and slurmctld port (module
    docstring: clusters of different numbers run side by side); ``None`` claims the first free one until
    :meth:`stop`. The client helpers are :class:`LocalSlurm`'s."""

    def __init__(self, root: Path, number: int | None = None):
        super().__init__(root)
        if number is None:
            number, self._slot = claim_slot("two-nodes", lambda i: port_free(CTLD_PORT + 10 * i))
        if not 0 <= number < 10:
            raise ValueError(f"TwoNodeSlurm number={number}: must be 0..9 (one subnet and port each)")
        subnet = f"10.223.{23 + number}"
        self.head_addr = f"{subnet}.1"
        #: each node's address on the bridge
        self.addrs = {n: f"{subnet}.{11 + i}" for i, n in enumerate(NODES)}
        self.ctld_port = CTLD_PORT + 10 * number
        self.bridge = f"k2slurm{number}-br"
        self._prefix, self._veth_prefix = f"k2slurm{number}", f"k2s{number}"  # (interface names: <= 15 chars)

    def netns(self, node: str) -> str:
        """The network namespace of ``node``."""
        return f"{self._prefix}-{node}"

    def netns_pids(self, node: str) -> list[int]:
        """Every process in ``node``'s network namespace (its slurmd, slurmstepd, the job's ranks)."""
        p = _run(["ip", "netns", "pids", self.netns(node)])
        return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []

    def hosts_file(self, node: str) -> Path:
        """``node``'s ``/etc/hosts`` (``ip netns exec`` also mounts it: ``/etc/netns/<netns>/hosts``)."""
        return Path("/etc/netns") / self.netns(node) / "hosts"

    def pidfile(self, node: str) -> Path:
        return self.root / f"slurmd-{node}.pid"

    # --- network ---------------------------------------------------------------------------------------

    def _make_network(self) -> None:
        taken = _run(["ip", "-o", "addr"]).stdout + _run(["ip", "route"]).stdout
        subnet = self.head_addr.rsplit(".", 1)[0]
        if f" {subnet}." in taken and self.bridge not in taken:
            raise SlurmUnavailable(f"the test subnet {subnet}.0/24 is already in use on this machine")
        self._remove_network()  # what an earlier run left behind
        _must(["ip", "link", "add", self.bridge, "type", "bridge"], NamespacesRefused)
        _must(["ip", "addr", "add", f"{self.head_addr}/24", "dev", self.bridge])
        _must(["ip", "link", "set", self.bridge, "up"])
        hosts = "".join(f"{a} {n}\n" for n, a in {self.host: self.head_addr, **self.addrs}.items())
        for node in NODES:
            ns, outer = self.netns(node), self._outer_veth(node)
            _must(["ip", "netns", "add", ns], NamespacesRefused)
            _must(["ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns], NamespacesRefused)
            _must(["ip", "link", "set", outer, "master", self.bridge])
            _must(["ip", "link", "set", outer, "up"])
            _must(["ip", "-n", ns, "addr", "add", f"{self.addrs[node]}/24", "dev", "eth0"])
            _must(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _must(["ip", "-n", ns, "link", "set", "lo", "up"])
            self.hosts_file(node).parent.mkdir(parents=True, exist_ok=True)
            self.hosts_file(node).write_text("127.0.0.1 localhost\n" + hosts)

    def _outer_veth(self, node: str) -> str:
        """The head's end of ``node``'s veth pair (on the bridge)."""
        return f"{self._veth_prefix}-{node}"

    def _remove_network(self) -> None:
        # (/etc/netns itself stays: another cluster's start may be writing its hosts files there)
        for node in NODES:
            _run(["ip", "netns", "del", self.netns(node)])
            _run(["ip", "link", "del", self._outer_veth(node)])  # (gVisor keeps a deleted netns's veth's outer end)
            shutil.rmtree(Path("/etc/netns") / self.netns(node), ignore_errors=True)
        _run(["ip", "link", "del", self.bridge])

    def set_link(self, node: str, up: bool) -> None:
        """Plug (``up``) or pull the network cable of ``node``: its veth end inside the namespace."""
        _must(["ip", "-n", self.netns(node), "link", "set", "eth0", "up" if up else "down"])

    # --- daemons ---------------------------------------------------------------------------------------

    def _write_conf(self) -> None:
        mem_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        nodes = [
            f"NodeName={n} NodeAddr={self.addrs[n]} NodeHostname={n} Port={SLURMD_PORTS[n]} "
            f"CPUs={os.cpu_count()} RealMemory={mem_mib * 4 // 10} State=UNKNOWN"
            for n in NODES
        ]
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=k2two",
                    f"SlurmctldHost={self.host}({self.head_addr})",
                    *BASE_CONF,
                    f"AuthInfo=socket={self.munge_socket}",
                    f"KillWait={KILL_WAIT_S}",
                    f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}/%n",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r}/slurmd-%n.pid",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
                    f"SlurmctldPort={self.ctld_port}",
                    *nodes,
                    f"PartitionName=two Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
                    "",
                ]
            )
        )

    def start_slurmd(self, node: str) -> None:
        """Start ``node``'s slurmd in its namespaces (it daemonises; its pid goes to :meth:`pidfile`)."""
        (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        # (not `ip netns exec`: it mounts a fresh /sys for the namespace, without the cgroup file systems
        # slurmd needs; a mount namespace of our own gets the node's /etc/hosts instead)
        p = _run(
            [
                "nsenter",
                f"--net=/run/netns/{self.netns(node)}",
                "unshare",
                "--mount",
                "--uts",
                "sh",
                "-c",
                f"mount --bind {self.hosts_file(node)} /etc/hosts && hostname {node} && "
                f'exec slurmd -f "$SLURM_CONF" -N {node}',
            ],
            env=self.env,
        )
        if p.returncode != 0:
            raise SlurmUnavailable(f"slurmd -N {node} failed to start: {p.stderr[-2000:]}")

    def start(self, timeout: float = 90) -> TwoNodeSlurm:
        ensure_installed()
        try:
            self._make_network()
            self._start_munge()
            self._write_conf()
            p = _run(["slurmctld", "-f", str(self.conf)], env=self.env)
            if p.returncode != 0:
                raise SlurmUnavailable(f"slurmctld failed to start: {p.stderr[-2000:]}")
            for node in NODES:
                self.start_slurmd(node)
            self.wait_idle(NODES, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_idle(self, nodes, timeout: float = 90) -> None:
        """Wait until every node of ``nodes`` is idle. Raises SlurmUnavailable with the logs' tails."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = self.node_states()
            if all(states.get(n) == "idle" for n in nodes):
                return
            time.sleep(1)
        raise SlurmUnavailable(
            f"nodes {list(nodes)} not idle within {timeout} s ({self.node_states()}): " + self.diagnose("")
        )

    def lose_node(self, node: str) -> None:
        """``node`` fails as a machine does: its cable is pulled (the others get no reset, only silence),
        then every process on it (slurmd, slurmstepd, the job's ranks) is SIGKILLed."""
        self.set_link(node, False)
        _kill_and_wait(self.netns_pids(node), timeout=0, first=signal.SIGKILL)

    def restore_node(self, node: str) -> None:
        """``node`` comes back: cable plugged, slurmd started (ReturnToService=2 puts it back in service)."""
        self.set_link(node, True)
        self.start_slurmd(node)

    def stop(self, timeout: float = 30) -> None:
        """Cancel every job, stop slurmctld, every slurmd and munged (pid files), kill whatever is still in
        a node's namespace (a job's ranks), remove the namespaces, the bridge and munged's directory; give
        the claimed number back."""
        if self.conf.exists():
            _run(["scancel", "--full", "--user=root"], env=self.env)
        pids = []
        for pidfile in [self.root / "slurmctld.pid", *map(self.pidfile, NODES), self.munge_dir / "munged.pid"]:
            try:
                pids.append(int(pidfile.read_text().strip()))
            except (OSError, ValueError):
                pass
        _kill_and_wait([p for p in pids if alive(p)], timeout)
        for node in NODES:
            _kill_and_wait(self.netns_pids(node), timeout=5)
        self._remove_network()
        shutil.rmtree(self.munge_dir, ignore_errors=True)
        release_slot(self._slot)
        self._slot = None

    def leftovers(self) -> list[str]:
        """What :meth:`stop` should have removed and is still there (empty after a clean stop)."""
        left = [f"pid {p} in {self.netns(n)}" for n in NODES for p in self.netns_pids(n)]
        left += [f"netns {self.netns(n)}" for n in NODES if Path(f"/run/netns/{self.netns(n)}").exists()]
        for pidfile in [self.root / "slurmctld.pid", *map(self.pidfile, NODES), self.munge_dir / "munged.pid"]:
            try:
                pid = int(pidfile.read_text().strip())
            except (OSError, ValueError):
                continue
            if alive(pid):
                left.append(f"{pidfile.name} pid {pid}")
        return left

    # --- client helpers --------------------------------------------------------------------------------

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` as ``sinfo -N`` prints it (``idle``, ``allocated``, ``down*``, ...)."""
        out = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def node_state(self) -> str:
        """One word for the whole cluster: ``idle`` when every node is, else the states joined by ``,``."""
        states = set(self.node_states().values())
        return states.pop() if len(states) == 1 else ",".join(sorted(states))

    def diagnose(self, job_id: str, tail: int = 3000) -> str:
        parts = [_run(["scontrol", "show", "job", job_id], env=self.env).stdout] if job_id else []
        for f in ["slurmctld.log", *(f"slurmd-{n}.log" for n in NODES)]:
            path = self.root / "log" / f
            if path.exists():
                parts.append(f"--- {f} (tail) ---\n" + path.read_text(errors="replace")[-tail:])
        return "\n".join(parts)


def _main(argv: list[str]) -> int:
    """``start DIR`` / ``stop DIR`` (module docstring)."""
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: python tests/support/slurm_two_nodes.py start|stop DIR", file=sys.stderr)
        return 2
    conf = Path(argv[1]) / "slurm.conf"
    if argv[0] == "stop":
        port = re.search(r"^SlurmctldPort=(\d+)$", conf.read_text(), re.M) if conf.exists() else None
        if port is None:
            print(f"slurm_two_nodes: {conf} names no SlurmctldPort: no cluster was started there", file=sys.stderr)
            return 1
        cluster = TwoNodeSlurm(Path(argv[1]), (int(port.group(1)) - CTLD_PORT) // 10)
        cluster.stop()
        left = cluster.leftovers()
        print("stopped" + (f"; still there: {left}" if left else ""))
        return 1 if left else 0
    cluster = TwoNodeSlurm(Path(argv[1]))  # (its number is held only while this starts it: then its port is)
    cluster.root.mkdir(parents=True, exist_ok=True)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        print(f"slurm_two_nodes: {e}", file=sys.stderr)
        return 1
    print(f"export SLURM_CONF={cluster.conf}   # nodes: {cluster.node_states()}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
