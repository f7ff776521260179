"""A real one-node Slurm cluster on localhost for tests (Debian's slurm-wlm 22.05 + munge, run as root).

How it was found to work on these machines: docs/slurm_local.md. ``LocalSlurm.start`` installs
the packages with apt-get when ``slurmctld`` is missing and ``K2_INSTALL_SLURM=1`` says so, claims a free pair of ports
(:func:`claim_slot`), starts a munged of its own (its own socket, the system key), writes a slurm.conf
into a temporary directory, starts slurmctld and slurmd with absolute paths, and waits until the node is
idle; ``stop`` stops what ``start`` started -- slurmctld, slurmd and its munged -- by their pid files,
waits for them to exit and gives the ports back. So clusters of the suite's xdist workers, and of other
checkouts' suites on the same machine, run side by side without touching each other. The installed
packages stay. Environment for the client commands: :attr:`env`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import time
import zlib
from pathlib import Path
from typing import IO

PACKAGES = ["slurm-wlm", "munge"]
#: slurm.conf lines every test cluster shares (docs/slurm_local.md: what worked here, as root)
BASE_CONF = [
    "SlurmUser=root",
    "AuthType=auth/munge",
    "ProctrackType=proctrack/linuxproc",
    "TaskPlugin=task/none",
    "SelectType=select/cons_tres",
    "SelectTypeParameters=CR_Core",
    "MpiDefault=none",
    "MailProg=/bin/true",
    "ReturnToService=2",
    "JobRequeue=1",
    "MinJobAge=600",
    "SchedulerType=sched/backfill",
]
#: the one-node clusters' ports: the cluster in slot i (:func:`claim_slot`) listens on FIRST_PORT + 2 i
#: (slurmctld) and FIRST_PORT + 2 i + 1 (slurmd), i < SLOTS: 26817-26836, below the two-node clusters'
#: slurmctld ports (tests/support/slurm_two_nodes.py) and outside Linux's ephemeral range (32768-60999),
#: where the ranks' and clients' own connections take theirs
FIRST_PORT = 26817
SLOTS = 10
#: where the slots' lock files are: one directory for every checkout on this machine
LOCK_DIR = Path("/tmp")


def wait_for(pred, timeout: float, what, every: float = 0.5):
    """Poll ``pred`` every ``every`` s until it is truthy and return its value; ``what()`` (called only on a
    timeout, so the job's log and Slurm's state in the message are those of that moment) names what was
    awaited in the AssertionError."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what()}")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message says which step failed and its output."""


class SlurmNotInstalled(SlurmUnavailable):
    """slurmctld or munged is missing and installing them was not asked for (``K2_INSTALL_SLURM=1``): a
    person's ``scripts/k2 test`` does not change the system unless told to; ``.ci/run`` tells it to."""


#: the environment variable that lets the Slurm tests install the system packages (root, apt-get)
INSTALL_OPT_IN = "K2_INSTALL_SLURM"


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


#: held while one test process installs the packages: the one-node and two-node Slurm files run on
#: different xdist workers, and a second ``apt-get`` started meanwhile fails on dpkg's lock
INSTALL_LOCK = Path("/tmp/k2-tests-slurm-install.lock")


def ensure_installed(timeout: int = 900) -> None:
    """apt-get install slurm-wlm munge when slurmctld is not on PATH and ``K2_INSTALL_SLURM=1`` (needs root
    and Debian's registry; :class:`SlurmNotInstalled` without the opt-in).
    One process installs at a time (:data:`INSTALL_LOCK`); the others wait for it and find the packages
    installed, and apt-get itself waits up to ``timeout`` s for a dpkg lock held by anything else."""
    from k2.launcher.datasets.locks import file_lock

    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    if os.environ.get(INSTALL_OPT_IN) != "1":
        raise SlurmNotInstalled(
            f"slurmctld and munged are not installed; {INSTALL_OPT_IN}=1 scripts/k2 test "
            f"installs {' '.join(PACKAGES)} with apt-get (root) and runs these tests"
        )
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmctld is not installed and installing it needs root (apt-get)")
    with file_lock(str(INSTALL_LOCK)):
        if shutil.which("slurmctld") and shutil.which("munged"):  # another worker installed them
            return
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        apt = ["apt-get", "-o", f"DPkg::Lock::Timeout={timeout}"]
        p = _run([*apt, "install", "-y", "-q", *PACKAGES], env=env, timeout=timeout)
        if p.returncode != 0:  # stale package lists on a fresh machine
            _run([*apt, "update", "-q"], env=env, timeout=timeout)
            p = _run([*apt, "install", "-y", "-q", *PACKAGES], env=env, timeout=timeout)
    if p.returncode != 0 or not shutil.which("slurmctld"):
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {p.stdout[-2000:]}{p.stderr[-2000:]}")


def alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def port_free(port: int) -> bool:
    """True when nothing on this machine listens on TCP ``port`` (a bind as slurmctld and slurmd make it,
    SO_REUSEADDR: a port left in TIME_WAIT by a stopped cluster counts as free)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def claim_slot(kind: str, usable, slots: int = SLOTS) -> tuple[int, IO]:
    """The first slot ``i < slots`` of test clusters of ``kind`` that no running test process on this
    machine holds and for which ``usable(i)`` is true (its ports are free: nothing else, such as the
    daemons of a test run that died, listens there), and the open lock file that holds it: an exclusive
    ``flock`` on ``LOCK_DIR/k2-tests-slurm-<kind>-<i>.lock`` (the file stays, empty), released by
    :func:`release_slot` or by the kernel when the process ends. Clusters of the suite's xdist workers
    and of other checkouts on this machine so never share ports, names or subnets. Raises
    SlurmUnavailable when every slot is taken."""
    for i in range(slots):
        lock = open(LOCK_DIR / f"k2-tests-slurm-{kind}-{i}.lock", "a")
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        if usable(i):
            return i, lock
        lock.close()  # (closing it releases the lock)
    raise SlurmUnavailable(
        f"all {slots} {kind} test-cluster slots are taken on this machine (held by "
        f"{LOCK_DIR}/k2-tests-slurm-{kind}-*.lock, or their ports in use)"
    )


def release_slot(lock: IO | None) -> None:
    """Give back a slot :func:`claim_slot` returned (``None``: nothing to give back)."""
    if lock is not None and not lock.closed:
        lock.close()


class LocalSlurm:
    """One node (this host, all its CPUs) in one default partition; state under ``root``; its ports
    (:attr:`ports`: slurmctld, slurmd) claimed by :meth:`start`."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        #: this cluster's own munged (the system's, if one runs, is not touched: another cluster may use it)
        self.munge_dir = Path(f"/run/k2slurm-munge-{zlib.crc32(str(self.root).encode()):08x}")
        self.munge_socket = self.munge_dir / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "MUNGE_SOCKET": str(self.munge_socket)}
        self._pidfiles = [self.root / "slurmctld.pid", self.root / "slurmd.pid"]
        self.ports: tuple[int, int] | None = None
        self._slot: IO | None = None

    def _claim_ports(self) -> None:
        def pair(i):
            return FIRST_PORT + 2 * i, FIRST_PORT + 2 * i + 1

        i, self._slot = claim_slot("one-node", lambda i: all(map(port_free, pair(i))))
        self.ports = pair(i)

    def _write_conf(self) -> None:
        mem_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=k2test",
                    f"SlurmctldHost={self.host}",
                    *BASE_CONF,
                    "KillWait=60",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    f"AuthInfo=socket={self.munge_socket}",
                    f"SlurmctldPort={self.ports[0]}",
                    f"SlurmdPort={self.ports[1]}",
                    f"NodeName={self.host} CPUs={os.cpu_count()} RealMemory={mem_mib * 9 // 10} State=UNKNOWN",
                    f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
                    "",
                ]
            )
        )

    def _start_munge(self) -> None:
        """Start this cluster's own munged on :attr:`munge_socket` (slurm.conf's ``AuthInfo=socket=``)."""
        d = self.munge_dir
        d.mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
        d.chmod(0o755)
        p = _run(
            [
                "su",
                "-s",
                "/bin/sh",
                "munge",
                "-c",
                f"munged --socket={self.munge_socket} --pid-file={d}/munged.pid --log-file={d}/munged.log "
                f"--seed-file={d}/munged.seed",
            ]
        )
        check = _run(["sh", "-c", f"munge -n -S {self.munge_socket} | unmunge -S {self.munge_socket}"])
        if "Success" not in check.stdout:
            raise SlurmUnavailable(f"munged did not start: {p.stderr}{check.stdout}{check.stderr}")

    def start(self, timeout: float = 60) -> LocalSlurm:
        ensure_installed()
        self._claim_ports()
        try:
            self._start_munge()
            self._write_conf()
            for daemon in ("slurmctld", "slurmd"):
                p = _run([daemon, "-f", str(self.conf)], env=self.env)
                if p.returncode != 0:
                    raise SlurmUnavailable(f"{daemon} failed to start: {p.stderr[-2000:]}")
            deadline = time.time() + timeout
            while time.time() < deadline:
                if self.node_state() in ("idle", "mixed"):
                    return self
                time.sleep(1)
            logs = "".join(
                (self.root / "log" / f).read_text()[-1500:]
                for f in ("slurmctld.log", "slurmd.log")
                if (self.root / "log" / f).exists()
            )
            raise SlurmUnavailable(f"the node did not become idle within {timeout} s (ports {self.ports}): {logs}")
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM slurmctld, slurmd and this cluster's munged; wait up to ``timeout`` seconds for each
        to exit, then SIGKILL what is left; remove munged's directory and give the ports back."""
        pidfiles = [*self._pidfiles, self.munge_dir / "munged.pid"]
        pids = []
        for pidfile in pidfiles:
            try:
                pid = int(pidfile.read_text().strip())
                os.kill(pid, 15)
                pids.append(pid)
            except (OSError, ValueError):
                pass
        deadline = time.time() + timeout
        for pid in pids:
            while alive(pid) and time.time() < deadline:
                time.sleep(0.2)
            if alive(pid):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        shutil.rmtree(self.munge_dir, ignore_errors=True)
        release_slot(self._slot)
        self._slot = None

    # --- client helpers --------------------------------------------------------------------------------

    def scontrol(self, *args: str) -> str:
        p = _run(["scontrol", *args], env=self.env)
        if p.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {p.stderr}")
        return p.stdout

    def node_state(self) -> str:
        """The node's state as ``sinfo`` prints it (``idle``, ``allocated``, ``completing``, ...)."""
        return _run(["sinfo", "-h", "-o", "%T"], env=self.env).stdout.strip()

    def diagnose(self, job_id: str, tail: int = 3000) -> str:
        """What to print when a job did not do what a test expected: ``scontrol show job`` and the last
        ``tail`` characters of the slurmctld and slurmd logs."""
        parts = [_run(["scontrol", "show", "job", job_id], env=self.env).stdout]
        for f in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / f
            if path.exists():
                parts.append(f"--- {f} (tail) ---\n" + path.read_text(errors="replace")[-tail:])
        return "\n".join(parts)

    def restart_now(self, job_id: str, restarts: int, log=lambda: "") -> None:
        """Once job ``job_id`` was requeued for the ``restarts``-th time, skip most of the requeue's BeginTime
        delay. That delay is what keeps the new run (same job id) clear of the old one's end: slurmd revokes
        the old run's credential when it kills it and refuses a batch launch whose credential is not
        newer, at 1-second resolution ("Job 1 already killed, do not launch batch job": the job fails
        without running a line). So the new run starts only once every node is idle and a few seconds have
        passed. ``log()`` goes into the message of a timeout."""
        wait_for(
            lambda: (
                self.job_field(job_id, "Restarts") == str(restarts) and self.job_field(job_id, "JobState") == "PENDING"
            ),
            120,
            lambda: f"restart {restarts} of job {job_id} to pend: {log()}",
        )
        wait_for(
            lambda: self.node_state() == "idle",
            120,
            lambda: f"the nodes to finish restart {restarts - 1} of job {job_id}: {self.diagnose(job_id)}",
        )
        time.sleep(3)
        self.scontrol("update", f"jobid={job_id}", "StartTime=now")

    def job_field(self, job_id: str, field: str) -> str:
        """A ``Key=Value`` field of ``scontrol show job`` (e.g. JobState, Restarts, ExitCode)."""
        for token in self.scontrol("show", "job", job_id).split():
            if token.startswith(field + "="):
                return token.split("=", 1)[1]
        return ""
