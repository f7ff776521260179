"""Hang watchdog (``run.hang_timeout_s``, ``run.hang_startup_timeout_s``): a run whose ranks make no
progress is stopped with one line naming the rank(s) that did not reach the point the others reached,
every rank's Python stacks on disk, and the requeue exit status, instead of waiting for the process
group's timeout (which names no rank) or, for a hang that never raises, for the job's time limit.

Protocol (own code: megatron-core and torch offer a per-collective timeout, not a cross-rank report that
works for a rank that is stopped, and nvidia-resiliency-ext's in-job restart needs its own launcher;
this one runs unchanged under k2-train's own launcher, torchrun and srun):

* The training loop marks **points** on every rank, in the same order: ``start-up``, ``step N``,
  ``eval N``, ``save N``, ``phase N`` (a schedule phase's datasets are built), ``export N`` (the Hugging
  Face export at the end, rank 0) (:meth:`HangWatchdog.progress`, in memory only).
* A daemon thread per rank writes ``<run.dir>/hang/<attempt>/rank<R>.json`` every ``tick`` seconds: host,
  pid, the current point, its sequence number, and an ``alive`` time. The thread keeps ticking while the
  main thread waits in a collective (gloo and NCCL waits release the GIL); a stopped or frozen process
  stops ticking.
* When a rank's own point has lasted longer than its allowance, the rank reads every heartbeat. The
  ranks named are those whose heartbeat is stale (stopped, frozen, gone) or whose sequence number is
  behind the highest one (they did not reach the last point the others reached).
* Every live rank then writes its own stacks (``faulthandler``, all threads) to
  ``hang/<attempt>/stacks_rank<R>.txt``; the lowest live rank of each host writes the stacks of the named
  ranks on its host with ``py-spy dump --nonblocking`` (which reads a stopped process too) and SIGKILLs
  them; the lowest live rank prints the one line, writes it to ``hang/<attempt>/report.txt`` and leaves
  ``<run.dir>/requeue`` (so k2-train's launcher and the batch script requeue,
  :mod:`k2.launcher.training.preemption`); the :meth:`HangWatchdog.on_hang` callbacks run; each live rank
  kills its own child processes and exits with :data:`REQUEUE_EXIT_CODE`. Nothing is saved: the last
  committed checkpoint stays ``latest`` (a save in progress stays ``.partial`` and is removed by the
  restart).

Allowances: the start-up (process groups to the first step, checkpoint load included) and the first
occurrence of each kind of point in this process (the first step compiles and warms caches, the first
save and evaluation have no measured time yet) get ``run.hang_startup_timeout_s``. Every later point gets
``run.hang_timeout_s``, or, when that is null, 10x the longest time a point of its kind took so far in
this process, at least :data:`FLOOR_S`. The process group's timeout is raised above the allowances
(:func:`process_group_timeout_s`) so that the watchdog, not a collective's error, ends a hang.

Test seam: ``K2_TEST_HANG=KIND:STEP:RANK`` stops global rank RANK (``SIGSTOP`` to itself) as it enters
point ``KIND STEP`` (``step``, ``eval`` or ``save``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from k2.launcher.checkpointing.background import in_flight_writer
from k2.launcher.checkpointing.paths import latest_checkpoint
from k2.launcher.progress import probes_grew, watch
from k2.launcher.training.preemption import REQUEUE_EXIT_CODE, REQUEUE_MARKER

if TYPE_CHECKING:
    from k2.config.schema import RunConfig

__all__ = ["FLOOR_S", "HANG_DIR", "HangWatchdog", "TEST_HANG_ENV", "process_group_timeout_s"]

#: ``<run.dir>/hang``: heartbeats, stacks and the report of each attempt
HANG_DIR = "hang"
#: environment variable of the test seam (module docstring)
TEST_HANG_ENV = "K2_TEST_HANG"
#: least derived allowance of a point, seconds
FLOOR_S = 120.0
#: derived allowance = this x the longest time a point of the same kind took
STEP_FACTOR = 10.0
#: process-group timeout floor, seconds (megatron / torch default: 600 s for NCCL, 30 min for gloo)
PG_TIMEOUT_FLOOR_S = 1200


def process_group_timeout_s(run_cfg: RunConfig) -> int:
    """The process group's timeout (seconds) for ``run`` settings: above every watchdog allowance, so
    that a hang is ended by the watchdog (which names the rank) rather than by a collective's error."""
    explicit = run_cfg.hang_timeout_s or 0
    return int(max(PG_TIMEOUT_FLOOR_S, 2 * run_cfg.hang_startup_timeout_s, 2 * explicit))


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


class HangWatchdog:
    """One rank's heartbeat and hang detection (module docstring).

    Args:
        run_dir: ``run.dir``; rank / world_size: this process's global rank and the world size.
        attempt: the name of this launch's heartbeat directory, the same on every rank
            (:meth:`for_run` agrees on it).
        timeout_s: ``run.hang_timeout_s`` (seconds; None = derived from the measured point times).
        startup_timeout_s: ``run.hang_startup_timeout_s`` (seconds).
        pg_timeout_s: the process group's timeout; a derived allowance stays 60 s below it.
        exit: called with the exit status after a hang was handled (tests replace ``os._exit``).
    """

    def __init__(
        self,
        run_dir,
        rank: int,
        world_size: int,
        attempt: str,
        timeout_s: float | None,
        startup_timeout_s: float,
        pg_timeout_s: float = 3600.0,
        exit: Callable[[int], None] = os._exit,
    ):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / HANG_DIR / attempt
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.startup_timeout_s = timeout_s, float(startup_timeout_s)
        self.pg_timeout_s = float(pg_timeout_s)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._exit = exit
        self._callbacks: list = []
        self._longest: dict = {}  # kind -> longest seconds a point of that kind took
        self._seq, self._kind, self._step = 0, "start-up", None
        self._since = time.monotonic()
        self._moved = time.time()  # wall time of this rank's last progress (heartbeats compare ranks)
        self._watching = contextlib.ExitStack()
        self._allowance = self.startup_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seam = self._parse_seam()
        self.report: str | None = None
        self._handling = False

    @classmethod
    def for_run(cls, run_cfg: RunConfig, run_dir, rank: int, world_size: int) -> HangWatchdog:
        """A started watchdog for this launch (collective when a process group exists: rank 0 names the
        attempt directory and broadcasts it)."""
        import torch.distributed as dist

        name = [f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"]
        if dist.is_initialized() and world_size > 1:
            dist.broadcast_object_list(name, src=0)
        return cls(
            run_dir,
            rank,
            world_size,
            name[0],
            run_cfg.hang_timeout_s,
            run_cfg.hang_startup_timeout_s,
            pg_timeout_s=process_group_timeout_s(run_cfg),
        ).start()

    # ------------------------------------------------------------------ the training loop's side

    def on_hang(self, fn: Callable[[str], None]) -> None:
        """Register ``fn(report_line)``: called on every live rank after a hang was detected, before the
        rank exits (e.g. to abandon an in-flight asynchronous save). It runs in the watchdog's thread
        while the main thread may be blocked in a collective: it must not call a collective nor wait for
        the main thread. Exceptions are printed, not raised."""
        self._callbacks.append(fn)

    def progress(self, kind: str, step: int | None = None) -> None:
        """Mark the start of point ``kind`` (``step`` / ``eval`` / ``save`` / ``phase`` / ``export``) of
        ``step`` on this rank."""
        now = time.monotonic()
        if self._kind != "start-up":
            self._longest[self._kind] = max(self._longest.get(self._kind, 0.0), now - self._since)
        self._seq += 1
        self._kind, self._step, self._since, self._moved = kind, step, now, time.time()
        self._allowance = self.allowance(kind)
        if self._seam == (kind, step, self.rank):
            os.kill(os.getpid(), signal.SIGSTOP)

    def keep_alive(self) -> None:
        """The current point is still moving (an evaluation batch done, a background checkpoint writer
        wrote more bytes since the last call, ...): its allowance starts again, and the heartbeat says
        when this rank last moved. Not a new point: the sequence number stays. Also the sink of
        :func:`k2.launcher.progress.moved` while the watchdog runs (any thread may call it)."""
        self._since = time.monotonic()
        self._moved = time.time()

    def allowance(self, kind: str) -> float:
        """Seconds a point of ``kind`` may last before it is a hang (module docstring, "Allowances")."""
        if kind == "start-up" or kind not in self._longest:
            return self.startup_timeout_s
        if self.timeout_s is not None:
            return float(self.timeout_s)
        return min(max(FLOOR_S, STEP_FACTOR * self._longest[kind]), self.pg_timeout_s - 60.0)

    def point(self) -> str:
        return self._kind if self._step is None else f"{self._kind} {self._step}"

    # ------------------------------------------------------------------ the thread

    @property
    def tick_s(self) -> float:
        """Seconds between heartbeats: a tenth of the shortest allowance, 0.5 to 5 s."""
        shortest = min(self.startup_timeout_s, self.timeout_s or FLOOR_S)
        return min(5.0, max(0.5, shortest / 10.0))

    @property
    def stale_s(self) -> float:
        """A heartbeat older than this belongs to a rank that stopped running."""
        return max(3.0 * self.tick_s, 5.0)

    def start(self) -> HangWatchdog:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._watching.enter_context(watch(self.keep_alive))
        self._beat()
        self._thread = threading.Thread(target=self._run, name="k2-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread; remove this rank's heartbeat (and the attempt directory once empty)."""
        self._stop.set()
        self._watching.close()
        if self._handling:  # the main thread got here through a peer's error: the thread ends the process
            self._thread.join()
        if self._thread is not None:
            self._thread.join(timeout=10)
        (self.dir / f"rank{self.rank}.json").unlink(missing_ok=True)
        for d in (self.dir, self.dir.parent):
            try:
                d.rmdir()
            except OSError:
                pass

    def _beat(self) -> None:
        _write_json(
            self.dir / f"rank{self.rank}.json",
            {
                "rank": self.rank,
                "host": self.host,
                "pid": self.pid,
                "point": self.point(),
                "seq": self._seq,
                "alive": time.time(),
                "moved": self._moved,
                "writer": in_flight_writer(),
            },
        )

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            if probes_grew():  # work this rank waits on (e.g. a library's writer threads) moved
                self.keep_alive()
            try:
                self._beat()
            except OSError:
                pass  # a full or flaky file system: the next tick tries again
            if time.monotonic() - self._since > self._allowance:
                if self._another_rank_moves():
                    continue
                self._handle_hang()
                return

    def _another_rank_moves(self) -> bool:
        """This rank's allowance ran out, but no rank is stopped or behind and some rank made progress
        within the allowance (e.g. rank 0 alone builds a dataset or exports while the others wait for
        it): not a hang. The heartbeats are read again after :attr:`stale_s`."""
        beats, now = self.read_heartbeats(), time.time()
        if self.culprits(beats, now) or not any(now - b.get("moved", 0.0) <= self._allowance for b in beats.values()):
            return False
        self._since = time.monotonic() - self._allowance + self.stale_s
        return True

    # ------------------------------------------------------------------ a hang

    def read_heartbeats(self) -> dict:
        """rank -> heartbeat record of every rank that wrote one."""
        beats = {}
        for r in range(self.world_size):
            try:
                beats[r] = json.loads((self.dir / f"rank{r}.json").read_text())
            except (OSError, ValueError):
                pass
        return beats

    def culprits(self, beats: dict, now: float) -> dict:
        """rank -> why it is named: no heartbeat, a stale one, or a point behind the others' without
        progress within the allowance (a rank that is behind but moving is working, not hung). A
        heartbeat is stale after :attr:`stale_s`, or after the allowance less one tick when that is
        shorter: a rank stopped when the others stopped moving is named as soon as their allowance ends."""
        top = max((b["seq"] for b in beats.values()), default=0)
        top_point = next((b["point"] for b in beats.values() if b["seq"] == top), "?")
        stale = min(self.stale_s, max(self._allowance - self.tick_s, self.tick_s))
        out = {}
        for r in range(self.world_size):
            b = beats.get(r)
            if b is None:
                out[r] = "wrote no heartbeat"
            elif now - b["alive"] > stale:  # (wall clocks of NTP-synchronised hosts: skew << stale_s)
                out[r] = f"stopped responding (last heartbeat at '{b['point']}'; host {b['host']}, pid {b['pid']})"
            elif b["seq"] < top and now - b.get("moved", 0.0) > self._allowance:
                out[r] = f"did not reach '{top_point}': still at '{b['point']}' (host {b['host']}, pid {b['pid']})"
        return out

    @staticmethod
    def writer_notes(beats: dict) -> list[str]:
        """What the ranks' background checkpoint writers are doing when they are not writing: stopped
        (SIGSTOP, a debugger) or in uninterruptible I/O (a dead file system), one note per rank."""
        notes = []
        for r, b in sorted(beats.items()):
            w = b.get("writer")
            if w and w.get("state") in ("T", "t", "D"):
                what = (
                    "is stopped (SIGSTOP or a debugger)"
                    if w["state"] in ("T", "t")
                    else "waits in uninterruptible I/O (the file system does not answer)"
                )
                notes.append(
                    f"rank {r}'s background checkpoint writer (host {b['host']}, pid {w['pid']}) {what} "
                    f"while writing step {w['step']} into {w['partial']}"
                )
        return notes

    def _handle_hang(self) -> None:
        """Name, dump, report, then -- once every rank's stacks are on disk, so that no peer's connection
        error ends a rank before it wrote its own -- kill the named ranks of this host and exit."""
        self._handling = True
        waited = time.monotonic() - self._since
        setting = (
            "run.hang_startup_timeout_s"
            if self._allowance == self.startup_timeout_s
            else ("run.hang_timeout_s" if self.timeout_s is not None else "derived run.hang_timeout_s")
        )
        beats, now = self.read_heartbeats(), time.time()
        named = self.culprits(beats, now)
        live = sorted(r for r, b in beats.items() if r not in named or r == self.rank)
        reporter = live[0] if live else self.rank
        doomed: list = []
        try:
            doomed = self._write_stacks(beats, named, live)
        except Exception as e:
            print(f"k2-train: hang watchdog (rank {self.rank}): writing stacks failed: {e}", flush=True)
        notes = [f"rank {r} {why}" for r, why in sorted(named.items())] + self.writer_notes(beats)
        who = "; ".join(notes) or (
            f"no rank is stopped or behind: every rank waits at '{self.point()}' (a collective that never completes?)"
        )

        latest = getattr(latest_checkpoint(self.run_dir), "name", "none")
        self.report = (
            f"k2-train: hang: no progress for {waited:.0f} s at '{self.point()}' ({setting}="
            f"{self._allowance:.0f}); {who}; stacks of every rank in {self.dir}; the ranks are "
            f"killed, exit status {REQUEUE_EXIT_CODE} (requeue) from the last checkpoint ({latest})"
        )
        if self.rank == reporter:
            print(self.report, flush=True)
            (self.dir / "report.txt").write_text(self.report + "\n")
            (self.run_dir / REQUEUE_MARKER).write_text(f"hang {self.point()}\n")
        for fn in self._callbacks:
            try:
                fn(self.report)
            except Exception as e:
                print(f"k2-train: hang watchdog (rank {self.rank}): on_hang callback failed: {e}", flush=True)
        self._wait_for_stacks(timeout=20.0)
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._kill_children()
        self._exit(REQUEUE_EXIT_CODE)

    def _write_stacks(self, beats: dict, named: dict, live: list) -> list:
        """This rank's stacks; the named ranks' of this host when this is its lowest live rank (returns
        their pids, to be killed)."""
        with open(self.dir / f"stacks_rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank} (host {self.host}, pid {self.pid}) at '{self.point()}', all threads:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        here = [r for r in live if r not in named and beats.get(r, {}).get("host") == self.host]
        if here and here[0] != self.rank:
            return []  # the lowest live rank of this host does the named ranks of this host
        spy, doomed = _py_spy(), []
        for r in named:
            b = beats.get(r)
            if b is None or b["host"] != self.host or r == self.rank:
                continue
            out = self.dir / f"stacks_rank{r}.txt"
            if spy is None:
                text = "py-spy is not installed: no stacks of a stopped rank (pip install py-spy)\n"
            else:
                p = subprocess.run(
                    [spy, "dump", "--pid", str(b["pid"]), "--nonblocking"], capture_output=True, text=True, timeout=60
                )
                text = p.stdout + p.stderr
            out.write_text(f"rank {r} (host {b['host']}, pid {b['pid']}), by py-spy from rank {self.rank}:\n{text}")
            doomed.append(b["pid"])
        return doomed

    def _wait_for_stacks(self, timeout: float) -> None:
        """Until every rank's stacks file exists (a launcher that kills the others as soon as one rank
        exits, e.g. srun, would lose those still being written), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all((self.dir / f"stacks_rank{r}.txt").exists() for r in range(self.world_size)):
                return
            time.sleep(0.2)

    @staticmethod
    def _kill_children() -> None:
        """SIGKILL this rank's own child processes (checkpoint writers, wandb's service) first: an
        ``os._exit`` would leave them running."""
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass

    # ------------------------------------------------------------------ test seam

    def _parse_seam(self):
        spec = os.environ.get(TEST_HANG_ENV)
        if not spec:
            return None
        kind, step, rank = spec.split(":")
        return kind, int(step), int(rank)
