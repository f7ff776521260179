"""Helpers for the processes a run starts: a free rendezvous port, the environment of a child that
starts a job of its own, and the two ways a child process ends with its parent (the kernel's
``PR_SET_PDEATHSIG`` and a watching thread).

One module for what the launcher (``k2-train``'s rank launcher, its forked ranks), the background
checkpoint writer, the benchmarks' worker processes and the tests all need, in the lowest layer that
starts process groups (:mod:`k2.parallel.distributed` picks a free port for a lone process too).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import threading

__all__ = ["JOB_VARS", "child_env", "die_with_parent", "exit_with_parent", "free_port"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: the variables that place a process in a distributed job: torch.distributed's rendezvous (``RANK``,
#: ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; :func:`k2.parallel.distributed.dist_env`
#: reads them) and ``K2_SPAWNED`` (set by ``k2-train``'s rank launcher on its ranks); Slurm's ``SLURM_*``
#: as well (:func:`child_env`)
JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "K2_SPAWNED")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that starts a job of its own (a trainer a benchmark runs,
    ``k2-convert`` after a run): this process's, without :data:`JOB_VARS` and ``SLURM_*`` (else the child
    would take this job's rank, world and rendezvous for its own), with ``extra`` set on top."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (the loopback interface by default), so that several local runs
    can coexist. The port is released when this returns: start the rendezvous soon after (another
    process may take an ephemeral port meanwhile)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when the thread that started it exits (Linux's
    ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; usable as ``subprocess.Popen``'s ``preexec_fn`` or right after
    ``os.fork``). Elsewhere nothing is set.

    Returns:
        True when the kernel took the setting, False where it is not available (not Linux).
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def exit_with_parent(poll_s: float = 0.5) -> threading.Thread:
    """In a rank spawned by ``k2-train``: a daemon thread that SIGKILLs this process as soon as its
    parent (the rank launcher, or torchrun) is gone, i.e. when this process is re-parented (checked every
    ``poll_s`` seconds).

    A thread as well as :func:`die_with_parent`: ``PR_SET_PDEATHSIG`` fires when the parent *thread*
    that forked the rank exits, which in another launcher (torchrun) need not be the one that lives as
    long as the launcher. A rank that finds itself already re-parented (its parent died before this call)
    is killed at once.

    Returns:
        the started thread.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            ppid = os.getppid()
            if ppid != parent or ppid == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Event().wait(poll_s)

    t = threading.Thread(target=watch, name="k2-exit-with-parent", daemon=True)
    t.start()
    return t
