"""Checkpoints written in the background (``checkpoint.async_save``): the loop waits only for staging.

Built on megatron-core 0.19.2's async dist-checkpointing: :func:`k2.launcher.checkpointing.store.begin_save`
plans the save with ``async_sharded_save=True, async_strategy="mcore"``, and megatron's
``AsyncCallsQueue`` (non-persistent: ``TemporalAsyncCaller``) forks one writer process per save. The fork
is the snapshot: the writer sees the rank's memory as it was at the step boundary (copy-on-write), so
the optimizer step that follows -- which updates host-resident (offloaded) optimizer states in place --
cannot leak into the checkpoint being written. Peers that pass CPU tensors to a persistent worker
through ``torch.multiprocessing`` move them into shared memory without a copy and got exactly that leak
(nvidia-resiliency-ext PR #376); a persistent worker also held its memory between saves (Megatron-Bridge
PR #359), and megatron's cached save structure is left off (``TorchDistSaveShardedStrategy``'s default)
because a stale cache made later checkpoints copies of the first (NeMo-RL #3312). On a GPU megatron's
``preload_fn`` first stages the tensors device -> host; on CPU they are already on the host.

The writer ignores SIGTERM / SIGUSR1 / SIGINT (a preemption notice is for the rank, which decides when
to stop), dies with its rank (``PR_SET_PDEATHSIG``, so a killed job leaves no writer behind that could
write into a later run's directory), runs at nice 10, writes its shards, hashes them for the manifest
and reports both through a pipe (:class:`PipeChannel`; megatron's default is a ``multiprocessing``
Manager process, which a job manager's SIGTERM to every process of the job step kills).

The commit -- megatron's metadata, our manifest, ``.partial`` -> ``iter_N``, ``latest`` -- is a finalize
function that every rank runs at the same step boundary: :meth:`BackgroundSaver.poll` asks all ranks
each step (megatron's one-integer all-reduce) and finalizes when every writer is done. At most one save
is in flight (the next one waits for it). Every exit path finalizes (:meth:`BackgroundSaver.wait`: end of
run, preemption, divergence) or abandons (:meth:`BackgroundSaver.abandon`, :func:`abandon_in_flight_save`:
an error, the hang watchdog): an abandoned save stays ``.partial`` and ``latest`` names the previous
checkpoint, so nothing complete-looking is ever wrong.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pickle
import queue
import signal
import struct
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from k2.launcher.checkpointing.store import CheckpointSaveError, begin_save, commit_save, shard_entries

__all__ = ["BackgroundSaver", "PipeChannel", "abandon_in_flight_save"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: seconds the rank waits for a finished writer's report to arrive through the pipe
REPORT_TIMEOUT_S = 60.0
_SAVERS: "list[BackgroundSaver]" = []  # of this process, for abandon_in_flight_save


class PipeChannel:
    """A one-way channel from a forked writer process to its rank: length-prefixed pickles over an
    ``os.pipe``, drained by a daemon thread in the rank, so that a large report never blocks the writer.
    Offers the ``put`` / ``get_nowait`` that megatron's ``FileSystemWriterAsync`` uses on its results
    queue (``get_nowait`` waits up to :data:`REPORT_TIMEOUT_S`: it is called once the writer has exited,
    while the thread may still be reading)."""

    def __init__(self):
        self._r, self._w = os.pipe()
        self._owner = os.getpid()
        self._items: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name="k2-ckpt-report", daemon=True)
        self._thread.start()

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = os.read(self._r, n - len(buf))
            if not chunk:
                return b""
            buf += chunk
        return buf

    def _drain(self) -> None:
        try:
            while True:
                head = self._read(8)
                if not head:
                    return
                self._items.put(pickle.loads(self._read(struct.unpack("<Q", head)[0])))
        except OSError:  # closed
            return

    def put(self, obj) -> None:
        """In the writer: send ``obj`` (picklable)."""
        data = pickle.dumps(obj)
        view = memoryview(struct.pack("<Q", len(data)) + data)
        while view:
            view = view[os.write(self._w, view):]

    def get_nowait(self):
        """In the rank: the next report (raises ``queue.Empty`` when none came within the timeout)."""
        return self._items.get(timeout=REPORT_TIMEOUT_S)

    def close(self) -> None:
        """In the rank, after the writer is gone: end the thread and free both ends."""
        if os.getpid() != self._owner or self._w < 0:
            return
        os.close(self._w)  # the last write end once the writer is gone: the thread reads EOF and ends
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            os.close(self._r)
        self._w = -1


def _writer_started() -> None:
    """Runs in the writer process before it writes. A no-op; tests replace it (e.g. to hold the
    writer while the rank trains on, or to kill the rank mid-write)."""


def _background_writer(write_fn, report: PipeChannel, partial: Path, *args, **kwargs) -> None:
    """The body of the forked writer: megatron's ``write_fn(rank, write_buckets, results_queue)`` (its
    shards into ``partial``), then this rank's manifest entries (or the exception) into ``report``."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the writer then outlives a killed rank by its write
        pass
    os.nice(10)  # the rank's next steps come first
    try:
        _writer_started()
        write_fn(*args, **kwargs)
        report.put(shard_entries(partial, args[1]))
    except BaseException as e:  # noqa: BLE001 - reported to the rank, which raises it at finalize
        report.put(RuntimeError(f"{type(e).__name__}: {e}"))


class BackgroundSaver:
    """One rank's background saves (module docstring). ``on_commit(path, step, why, seconds)`` runs on
    every rank when a save is committed (``seconds``: from staging to commit).

    Collective: :meth:`save`, :meth:`poll` and :meth:`wait` on every rank at the same step.
    """

    def __init__(self, run_dir, keep_last: int, keep_every: Optional[int],
                 on_commit: Callable[[Path, int, str, float], None]):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.run_dir, self.keep_last, self.keep_every, self.on_commit = run_dir, keep_last, keep_every, on_commit
        self.queue = AsyncCallsQueue(persistent=False)  # a fresh fork per save: the snapshot
        self.in_flight: Optional[dict] = None
        _SAVERS.append(self)

    def save(self, step: int, why: str, model: list, optimizer, state: dict, config_yaml: str) -> None:
        """Stage checkpoint ``step`` and start its writer; waits first for a save still in flight.

        Raises:
            CheckpointSaveError: on every rank (one line naming the directory and the rank).
        """
        self.wait()
        results, report = PipeChannel(), PipeChannel()
        t0 = time.perf_counter()
        try:
            partial, final, request = begin_save(self.run_dir, step, model, optimizer, results_queue=results)
        except BaseException:
            results.close(), report.close()
            raise
        if request.async_fn is not None:
            request = request._replace(async_fn=functools.partial(_background_writer, request.async_fn, report,
                                                                  partial))
        else:  # nothing to write on this rank: no writer, no shards
            report.put({})

        def commit() -> None:
            entries = report.get_nowait()
            if isinstance(entries, BaseException):
                raise entries
            path = commit_save(partial, final, step, entries, state, config_yaml, self.keep_last,
                               self.keep_every)
            self.on_commit(path, step, why, time.perf_counter() - t0)

        request.add_finalize_fn(commit)
        self.in_flight = {"step": step, "partial": partial, "channels": (results, report)}
        self.queue.schedule_async_request(request)

    def poll(self, blocking: bool = False) -> None:
        """Commit the save in flight when every rank's writer is done (``blocking``: wait for them).

        Raises:
            CheckpointSaveError: a writer failed (every rank raises; ``latest`` is unchanged).
        """
        if self.in_flight is None:
            return
        flight = self.in_flight
        try:
            done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointSaveError:
            self._forget()
            raise
        except Exception as e:  # megatron's CheckpointException: the failing rank is in its text
            self._forget()
            first = (str(e).strip().splitlines() or [""])[0]
            raise CheckpointSaveError(f"writing checkpoint step {flight['step']} into {flight['partial']} "
                                      f"failed: {type(e).__name__}: {first}") from e
        if done:
            self._forget()

    def wait(self) -> None:
        """Commit the save in flight, waiting for its writers (collective)."""
        self.poll(blocking=True)

    def abandon(self) -> None:
        """Kill the writer of the save in flight, without any collective: it stays ``.partial`` (removed
        at the next start) and ``latest`` keeps naming the previous checkpoint. Idempotent."""
        if self.in_flight is None:
            return
        for call in list(self.queue.async_calls):
            call.async_caller.close(abort=True)
        self.queue.async_calls.clear()
        self._forget()

    def _forget(self) -> None:
        if self.in_flight is not None:
            for ch in self.in_flight["channels"]:
                ch.close()
        self.in_flight = None

    def close(self) -> None:
        """Stop tracking this saver (after :meth:`wait` or :meth:`abandon`)."""
        self.abandon()
        if self in _SAVERS:
            _SAVERS.remove(self)


def abandon_in_flight_save() -> None:
    """Abandon every background save of this process (:meth:`BackgroundSaver.abandon`): for exit paths
    where the ranks cannot agree any more (an error on one rank, a hang watchdog). No collective."""
    for saver in list(_SAVERS):
        saver.abandon()
