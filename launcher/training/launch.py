"""Starting training processes from ``k2-train`` itself: local ranks under torchrun, a child run, and the
signals passed on to them (so that killing the parent by pid leaves nothing running unattended)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil

from k2.launcher.training.preemption import REQUEUE_EXIT_CODE, REQUEUE_MARKER

__all__ = ["forwarding_signals", "free_port", "spawn_local_ranks"]

#: signals a launcher passes on to the processes it started
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def free_port() -> int:
    """An unused TCP port on the loopback interface (so that several local runs can coexist)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def forwarding_signals(child: subprocess.Popen, to_workers: bool) -> Iterator[None]:
    """While inside, SIGINT / SIGTERM / SIGUSR1 sent to this process are passed on to ``child``.

    Args:
        child: the started process.
        to_workers: ``child`` is torchrun: SIGTERM and SIGUSR1 go to its worker processes directly as
            SIGTERM (torchrun itself would kill them after its own 30 s grace, before they could save a
            checkpoint); SIGINT goes to torchrun, which stops the ranks at once. Otherwise every signal
            goes to ``child`` as it came.

    The previous handlers are restored on exit.
    """
    def forward(signum, _frame):
        if not to_workers or signum == signal.SIGINT:
            child.send_signal(signum)
            return
        try:
            workers = psutil.Process(child.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            workers = []
        if not workers:  # not started yet (or gone): torchrun stops whatever there is
            child.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass

    old = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def spawn_local_ranks(cfg, overrides: list[str]) -> int:
    """Re-launch ``k2.launcher.train`` under ``torch.distributed.run`` with ``launch.nproc_per_node`` ranks.

    Signals: see :func:`forwarding_signals` (the ranks save a checkpoint and stop on SIGTERM / SIGUSR1:
    :mod:`k2.launcher.training.preemption`). Killing ``k2-train`` by pid therefore leaves no orphaned
    rank behind.

    Returns:
        torchrun's exit code, or :data:`REQUEUE_EXIT_CODE` when the ranks stopped for preemption
        (torchrun reports only that its workers failed; rank 0 leaves ``<run.dir>/requeue``).
    """
    port = cfg.launch.master_port or free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={cfg.launch.nproc_per_node}",
        "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={port}",
        "-m", "k2.launcher.train", *overrides,
    ]
    env = dict(os.environ)
    env["K2_SPAWNED"] = "1"  # the ranks need not re-announce what this process already did
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.launch.nproc_per_node)))
    print(f"k2-train: spawning {cfg.launch.nproc_per_node} local ranks: {' '.join(cmd[2:])}", flush=True)
    child = subprocess.Popen(cmd, env=env)
    with forwarding_signals(child, to_workers=True):
        rc = child.wait()
    marker = Path(cfg.run.dir) / REQUEUE_MARKER
    if rc != 0 and marker.exists():
        print(f"k2-train: the ranks saved step {marker.read_text().strip()} and stopped for preemption; "
              f"exit status {REQUEUE_EXIT_CODE} (requeue)", flush=True)
        return REQUEUE_EXIT_CODE
    return rc
