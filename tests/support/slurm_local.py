"""A real one-node Slurm cluster on localhost for tests (Debian's slurm-wlm 22.05 + munge, run as root).

How it was found to work on these machines: docs/slurm_local.md. ``LocalSlurm.start`` installs
the packages with apt-get when ``slurmctld`` is missing, starts munged (unless one already answers),
writes a slurm.conf into a temporary directory, starts slurmctld and slurmd with absolute paths, and
waits until the node is idle; ``stop`` stops what ``start`` started -- slurmctld, slurmd, and munged
when it was not running before -- by their pid files, and waits for them to exit. The installed packages
stay. Environment for the client commands: :attr:`env`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

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
#: where Debian's munged writes its pid
MUNGED_PIDFILE = Path("/run/munge/munged.pid")


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


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


#: held while one test process installs the packages: the one-node and two-node Slurm files run on
#: different xdist workers, and a second ``apt-get`` started meanwhile fails on dpkg's lock
INSTALL_LOCK = Path("/tmp/k2-tests-slurm-install.lock")


def ensure_installed(timeout: int = 900) -> None:
    """apt-get install slurm-wlm munge when slurmctld is not on PATH (needs root and Debian's registry).
    One process installs at a time (:data:`INSTALL_LOCK`); the others wait for it and find the packages
    installed, and apt-get itself waits up to ``timeout`` s for a dpkg lock held by anything else."""
    from k2.launcher.datasets.locks import file_lock

    if shutil.which("slurmctld") and shutil.which("munged"):
        return
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


class LocalSlurm:
    """One node (this host, all its CPUs) in one default partition; state under ``root``."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pidfiles = [self.root / "slurmctld.pid", self.root / "slurmd.pid"]
        self._started_munged = False

    def _write_conf(self) -> None:
        mem_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join([
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
            "SlurmctldPort=26817",
            "SlurmdPort=26818",
            f"NodeName={self.host} CPUs={os.cpu_count()} RealMemory={mem_mib * 9 // 10} State=UNKNOWN",
            f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            "",
        ]))

    def _start_munge(self) -> None:
        if _run(["sh", "-c", "munge -n | unmunge"]).returncode == 0:
            return
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        p = _run(["su", "-s", "/bin/sh", "munge", "-c", "munged"])
        self._started_munged = p.returncode == 0
        time.sleep(1)
        check = _run(["sh", "-c", "munge -n | unmunge"])
        if "STATUS:" not in check.stdout or "Success" not in check.stdout:
            raise SlurmUnavailable(f"munged did not start: {p.stderr}{check.stdout}{check.stderr}")

    def start(self, timeout: float = 60) -> LocalSlurm:
        ensure_installed()
        self._start_munge()
        self._write_conf()
        for daemon in ("slurmctld", "slurmd"):
            p = _run([daemon, "-f", str(self.conf)], env=self.env)
            if p.returncode != 0:
                raise SlurmUnavailable(f"{daemon} failed to start: {p.stderr[-2000:]}")
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = _run(["sinfo", "-h", "-o", "%T"], env=self.env).stdout.strip()
            if state in ("idle", "mixed"):
                return self
            time.sleep(1)
        logs = "".join((self.root / "log" / f).read_text()[-1500:] for f in ("slurmctld.log", "slurmd.log")
                       if (self.root / "log" / f).exists())
        self.stop()
        raise SlurmUnavailable(f"the node did not become idle within {timeout} s: {logs}")

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM slurmctld, slurmd and (when :meth:`start` started it) munged; wait up to ``timeout``
        seconds for each to exit, then SIGKILL what is left."""
        pidfiles = list(self._pidfiles) + ([MUNGED_PIDFILE] if self._started_munged else [])
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
        self._started_munged = False

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
        wait_for(lambda: self.job_field(job_id, "Restarts") == str(restarts)
                 and self.job_field(job_id, "JobState") == "PENDING", 120,
                 lambda: f"restart {restarts} of job {job_id} to pend: {log()}")
        wait_for(lambda: self.node_state() == "idle", 120,
                 lambda: f"the nodes to finish restart {restarts - 1} of job {job_id}: {self.diagnose(job_id)}")
        time.sleep(3)
        self.scontrol("update", f"jobid={job_id}", "StartTime=now")

    def job_field(self, job_id: str, field: str) -> str:
        """A ``Key=Value`` field of ``scontrol show job`` (e.g. JobState, Restarts, ExitCode)."""
        for token in self.scontrol("show", "job", job_id).split():
            if token.startswith(field + "="):
                return token.split("=", 1)[1]
        return ""
