"""Starting training processes from ``k2-train`` itself: local ranks (forked by
:mod:`k2.launcher.training.fork_ranks` from one process that imported the trainer once), a child run, and
the signals passed on to them (so that killing the parent by pid leaves nothing running unattended).

Signals go only to the rank processes (the rank launcher's direct children), never to what a rank started
itself (wandb's service, megatron's checkpoint-writer helpers): those end with their rank. When the
parent dies without passing anything on (``kill -9``), the kernel kills the rank launcher
(``PR_SET_PDEATHSIG``), which takes its ranks with it the same way, and each rank kills itself as soon as
its parent is gone (:func:`k2.parallel.processes.exit_with_parent`), so no rank outlives its launcher.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from k2.launcher.training.preemption import (
    INTERRUPT_EXIT,
    INTERRUPT_MARKER,
    REQUEUE_EXIT_CODE,
    REQUEUE_MARKER,
    hard_stop,
    kept_note,
)
from k2.parallel.processes import die_with_parent, free_port

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = ["forwarding_signals", "spawn_local_ranks"]

#: signals a launcher passes on to the processes it started
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def forwarding_signals(
    child: subprocess.Popen, to_workers: bool, run_dir=None, interrupts: list | None = None
) -> Iterator[None]:
    """While inside, SIGINT / SIGTERM / SIGUSR1 sent to this process are passed on to ``child``.

    Args:
        child: the started process.
        to_workers: ``child`` is the rank launcher: SIGTERM and SIGUSR1 go to its rank processes directly
            as SIGTERM (a launcher that stopped a failed group would kill the others after a 30 s grace,
            before they could save a checkpoint); SIGINT goes to the launcher, which passes it on to every
            rank (each saves the step in progress and stops: Ctrl-C). Otherwise every signal
            goes to ``child`` as it came. Only the launcher's direct children (the ranks) are signalled:
            a rank's own helpers (wandb's service) would die of SIGTERM and take the rank's logger
            with them before it saved.
        run_dir: ``run.dir``, for the line of a second Ctrl-C.
        interrupts: the time of every SIGINT is appended (the caller learns that Ctrl-C was pressed).

    A second SIGINT stops every process of the run at once
    (:func:`k2.launcher.training.preemption.hard_stop`): a person pressing Ctrl-C again means now.

    The previous handlers are restored on exit.
    """
    pressed: list = [] if interrupts is None else interrupts

    def forward(signum, _frame):
        if signum == signal.SIGINT:
            if pressed:
                hard_stop(run_dir, "Ctrl-C again")
            pressed.append(time.monotonic())
        if not to_workers or signum == signal.SIGINT:
            child.send_signal(signum)
            return
        try:
            workers = psutil.Process(child.pid).children(recursive=False)
        except psutil.NoSuchProcess:
            workers = []
        if not workers:  # not started yet (or gone): the launcher stops whatever there is
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


def spawn_local_ranks(cfg: K2Config, plan, entry: Callable[[Any, Any], int]) -> int:
    """Start ``launch.nproc_per_node`` local ranks that each call ``entry(cfg, plan)``, forked by
    :mod:`k2.launcher.training.fork_ranks` (one import of the trainer for all of them), and wait for them.

    The ranks get this process's composed config and plan as they are (pickled through a pipe that
    fork_ranks reads once before it forks: no file to write or leave behind): they neither compose the
    config nor plan the run again, so every rank trains what this process validated and decided (the
    resume checkpoint chosen under the run dir's lock included).

    Signals: see :func:`forwarding_signals` (the ranks save a checkpoint and stop on SIGTERM / SIGUSR1:
    :mod:`k2.launcher.training.preemption`). Killing ``k2-train`` by pid therefore leaves no orphaned
    rank behind, with any signal (module docstring). The caller holds the run directory's lock
    (:class:`k2.launcher.checkpointing.run_lock.RunDirLock`); the ranks do not take it.

    Args:
        cfg: the read-only config of :func:`k2.config.load_config`.
        plan: its :class:`k2.launcher.training.prepare.RunPlan` for ``launch.nproc_per_node`` ranks.
        entry: a module-level function (pickled by its name): ``k2.launcher.train.rank_main``.

    Returns:
        the first failed rank's exit status (e.g. 3 when training diverged), or
        :data:`REQUEUE_EXIT_CODE` when the ranks stopped for preemption: the ranks exit 0 after a
        preemption save and rank 0 leaves ``<run.dir>/requeue``, which this function turns into the
        requeue status; 0 when the run finished.
    """
    port = cfg.launch.master_port or free_port()
    nproc = cfg.launch.nproc_per_node
    env = dict(os.environ)
    env["K2_SPAWNED"] = "1"  # the ranks need not re-announce what this process already did
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    read_fd, write_fd = os.pipe()
    cmd = [
        sys.executable,
        "-m",
        "k2.launcher.training.fork_ranks",
        str(nproc),
        f"--master-port={port}",
        f"--call-fd={read_fd}",
    ]
    print(
        f"k2-train: spawning {nproc} local ranks (forked after one import of the trainer; rendezvous "
        f"127.0.0.1:{port}), each running {entry.__module__}.{entry.__qualname__} with this composed "
        f"config and plan",
        flush=True,
    )
    try:
        child = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, pass_fds=(read_fd,))
    finally:
        os.close(read_fd)
    # written from a thread: the pipe holds 64 KiB, and the launcher reads only after its imports (seconds),
    # while this thread must be passing signals on from the start
    threading.Thread(
        target=_send, args=(write_fd, pickle.dumps((entry, (cfg, plan)))), name="k2-send-call", daemon=True
    ).start()
    interrupts: list = []
    with forwarding_signals(child, to_workers=True, run_dir=cfg.run.dir, interrupts=interrupts):
        rc = child.wait()
    return _exit_status(cfg.run.dir, rc, interrupted=bool(interrupts))


def _exit_status(run_dir: str | Path, rc: int, interrupted: bool) -> int:
    """``k2-train``'s exit status once the forked ranks ended with ``rc`` (``interrupted``: Ctrl-C reached this
    process), from the marker rank 0 left in ``run_dir``: :data:`INTERRUPT_EXIT` after Ctrl-C,
    :data:`REQUEUE_EXIT_CODE` after a preemption save or a hang, else ``rc``; says which in one line."""
    stopped = Path(run_dir) / INTERRUPT_MARKER
    if stopped.exists():
        print(
            f"k2-train: the ranks saved step {stopped.read_text().strip()} and stopped (Ctrl-C); exit status "
            f"{INTERRUPT_EXIT}",
            flush=True,
        )
        return INTERRUPT_EXIT
    if interrupted and rc != 0:  # stopped before the ranks could agree on a save (start-up)
        print(
            f"k2-train: stopped by Ctrl-C (the ranks ended with status {rc}); {kept_note(run_dir)}",
            file=sys.stderr,
            flush=True,
        )
        return INTERRUPT_EXIT
    marker = Path(run_dir) / REQUEUE_MARKER
    if marker.exists() and marker.read_text().startswith("hang"):  # the ranks' hang watchdog stopped them
        print(
            f"k2-train: the ranks were stopped by the hang watchdog ({marker.read_text().strip()}); exit "
            f"status {REQUEUE_EXIT_CODE} (requeue)",
            flush=True,
        )
        return REQUEUE_EXIT_CODE
    if marker.exists():
        print(
            f"k2-train: the ranks saved step {marker.read_text().strip()} and stopped for preemption; "
            f"exit status {REQUEUE_EXIT_CODE} (requeue)",
            flush=True,
        )
        return REQUEUE_EXIT_CODE
    return rc


def _send(fd: int, payload: bytes) -> None:
    """Write ``payload`` into the pipe ``fd`` and close it (the reader's end of file); a launcher that died
    first (broken pipe) is reported by its exit status instead."""
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(payload)
    except BrokenPipeError:
        pass
