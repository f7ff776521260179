"""Checkpoints written in the background (``checkpoint.async_save``): the loop waits only for staging.

Built on megatron-core 0.19.2's async dist-checkpointing: :func:`k2.launcher.checkpointing.store.begin_save`
plans the save with ``async_sharded_save=True, async_strategy="mcore"``, and megatron's
``AsyncCallsQueue`` (non-persistent: ``TemporalAsyncCaller``) forks one writer process per save. The fork
is the snapshot: the writer sees the rank's private memory as it was at the step boundary (copy-on-write),
so the optimizer step that follows -- which updates host-resident (offloaded) optimizer states in place --
cannot leak into the checkpoint being written. Not all host memory is copy-on-write: pinned memory (the
NVIDIA driver maps it shared, open-gpu-kernel-modules ``nv-mmap.c``; "pin_memory lacks Copy-On-Write
under fork", Megatron-LM PR #2288) and shared memory are the same pages in both processes, and on a GPU
the offloaded optimizer states live in pinned buffers that every step overwrites (QK-Clip rescales
master copies there too). So before the fork every tensor of the write that lies in such memory is
copied into private memory (:func:`_private_host_copies`, run where megatron stages device tensors to the
host); everything else is left to the fork. The fork also makes megatron's staging copy of every tensor
that is a view of a larger buffer (its ``prepare_write_data`` clones those in the rank: a
DistributedOptimizer's states and the parameters of DDP's buffer, the whole checkpoint here) redundant,
so the rank skips it (:func:`_snapshot_writer_class`) and the writer copies those views after the fork
(:func:`_copy_views`), off the training loop. Peers that pass CPU tensors to a persistent worker
through ``torch.multiprocessing`` move them into shared memory without a copy and got exactly that leak
(nvidia-resiliency-ext PR #376); a persistent worker also held its memory between saves (Megatron-Bridge
PR #359). Cached save structures made later checkpoints copies of the first at a peer (NeMo-RL #3312):
the cache used here holds plans only, never data, and is dropped whenever the structure changes
(:func:`k2.launcher.checkpointing.staging.save_strategy`). On a GPU megatron's
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
run, preemption, divergence) or abandons (:meth:`BackgroundSaver.abandon`, through
:meth:`k2.launcher.checkpointing.manager.CheckpointManager.abandon`: an error, the hang watchdog): an
abandoned save stays ``.partial`` and ``latest`` names the previous
checkpoint, so nothing complete-looking is ever wrong.
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import signal
import struct
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from k2.launcher.checkpointing.store import CheckpointSaveError, agree, begin_save, commit_save, shard_entries
from k2.launcher.gc_pause import gc_paused
from k2.parallel.distributed import all_reduce_int
from k2.parallel.processes import die_with_parent

__all__ = ["BackgroundSaver", "CheckpointWriterDied", "PipeChannel", "in_flight_writer"]

#: seconds the rank waits for a finished writer's report to arrive through the pipe
REPORT_TIMEOUT_S = 60.0
_SAVERS: list[BackgroundSaver] = []  # of this process, for in_flight_writer


class PipeChannel:
    """A one-way channel from a forked writer process to its rank: length-prefixed pickles over an
    ``os.pipe``, drained by a daemon thread in the rank, so that a large report never blocks the writer.
    Offers the ``put`` / ``get_nowait`` that megatron's ``FileSystemWriterAsync`` uses on its results
    queue. Both are read only once the writer has exited: :meth:`get_nowait` then closes the rank's own
    write end, so the thread reads what the writer sent up to end-of-file, and returns at once whether a
    report came or not (a writer killed before it reported costs no wait; the thread is given up to
    :data:`REPORT_TIMEOUT_S` only while a process the writer forked still holds the pipe open)."""

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
            view = view[os.write(self._w, view) :]

    def get_nowait(self):
        """In the rank, once the writer has exited: its next report.

        Raises:
            queue.Empty: the writer sent none (it was killed, or exited without reporting).
        """
        self._finish(REPORT_TIMEOUT_S)
        return self._items.get_nowait()

    def _finish(self, timeout: float) -> None:
        """Close the rank's write end (the last one once the writer is gone) and wait up to ``timeout``
        seconds for the thread to read the rest and end; the read end is freed when it did."""
        if os.getpid() != self._owner or self._w < 0:
            return
        os.close(self._w)
        self._w = -1
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            os.close(self._r)

    def close(self) -> None:
        """In the rank, after the writer is gone: end the thread and free both ends."""
        self._finish(2.0)


@functools.cache
def _snapshot_writer_class():
    """megatron-core 0.19.2's ``FileSystemWriterAsync`` whose ``prepare_write_data`` leaves views
    uncopied (module docstring); only for a writer that is a fork of the rank taken right after it."""
    import torch
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    class _NoClone(torch.overrides.TorchFunctionMode):
        """``Tensor.clone()`` returns the tensor itself: megatron's ``prepare_write_data`` clones a view
        so that the bytes written later are those of the step boundary, which the fork keeps already."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.clone and len(args) == 1 and not kwargs:
                return args[0]
            return func(*args, **(kwargs or {}))

    class SnapshotWriterAsync(FileSystemWriterAsync):
        def prepare_write_data(self, plan, planner) -> None:
            with _NoClone():
                super().prepare_write_data(plan, planner)

        @staticmethod
        def preload_tensors(write_buckets, non_blocking=True):
            """megatron's staging (device tensors -> host, in the rank, before the fork), after the host
            tensors a fork would share are copied (:func:`_private_host_copies`)."""
            return FileSystemWriterAsync.preload_tensors(_private_host_copies(write_buckets), non_blocking)

    return SnapshotWriterAsync


def _shared_with_a_fork(t) -> bool:
    """True for a host tensor whose pages a forked child shares instead of copying on write: pinned
    (page-locked by the CUDA driver) or shared memory (``share_memory_``, ``/dev/shm``)."""
    return t.device.type == "cpu" and (t.is_shared() or t.is_pinned())


def _private_host_copies(write_buckets: list) -> list:
    """megatron's ``write_buckets`` (``(path, file_name, (bytes_data, tensor_data))``) with every tensor in
    memory a fork shares (:func:`_shared_with_a_fork`) replaced by a contiguous copy in private (pageable)
    memory: the bytes of this step, whatever the rank writes into its buffers while the writer runs. Costs
    one host copy of those bytes in the training loop (on a GPU: the offloaded optimizer states); the
    copies are released when the save is committed. Other tensors are returned as they are."""
    import torch

    out = []
    for path, name, (bytes_data, tensor_data) in write_buckets:
        tensors = [
            (item, torch.empty(t.shape, dtype=t.dtype).copy_(t) if _shared_with_a_fork(t) else t)
            for item, t in tensor_data
        ]
        out.append((path, name, (bytes_data, tensors)))
    return out


def _copy_views(write_buckets: list) -> list:
    """In the writer: megatron's ``write_buckets`` (``(path, file_name, (bytes_data, tensor_data))``) with
    every tensor that is a view of a larger storage copied (``torch.save`` of a view writes its whole
    storage; megatron's own test for a view)."""
    out = []
    for path, name, (bytes_data, tensor_data) in write_buckets:
        tensors = [
            (item, t.clone() if t.untyped_storage().size() != t.numel() * t.itemsize else t) for item, t in tensor_data
        ]
        out.append((path, name, (bytes_data, tensors)))
    return out


def _writer_started() -> None:
    """Runs in the writer process before it writes. A no-op; tests replace it (e.g. to hold the
    writer while the rank trains on, or to kill the rank mid-write)."""


class CheckpointWriterDied(RuntimeError):
    """A background writer ended without reporting (killed by a signal, or exited): the message says how."""


def _write_error(e: BaseException, partial: Path) -> BaseException:
    """``e`` with the cause in words for the errors a full or failing file system gives (the OSError of a
    failed ``write`` names no file)."""
    import errno

    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left" if e.errno == errno.ENOSPC else "the disk quota is exceeded"
        return OSError(e.errno, f"{what} on the file system of {partial} ({e.strerror})")
    return e


def _recording_write_errors(errors: list):
    """In the writer: megatron-core 0.19.2's ``FileSystemWriterAsync.write_preloaded_data`` returns a
    write error as data, and ``write_preloaded_data_multithread`` replaces it with an assertion about its
    type ("<class 'OSError'>"); the original error (ENOSPC, EIO, ...) is recorded here for the report."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.write_preloaded_data

    def write_preloaded_data(*args, **kwargs):
        out = original(*args, **kwargs)
        if out is not None and isinstance(out[1], BaseException):
            errors.append(out[1])
        return out

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)  # (this process only)


def _background_writer(write_fn, report: PipeChannel, partial: Path, *args, **kwargs) -> None:
    """The body of the forked writer: megatron's ``write_fn(rank, write_buckets, results_queue)`` (its
    shards into ``partial``), then this rank's manifest entries (or the first write error, with its cause
    in words: :func:`_write_error`) into ``report``."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()  # (not Linux: the writer then outlives a killed rank by its write)
    os.nice(10)  # the rank's next steps come first
    # one intra-op thread: the rank's OpenMP pool did not survive the fork, and a parallel torch op
    # (the copies of _copy_views) would wait for it forever (torch's DataLoader workers do the same)
    import torch

    torch.set_num_threads(1)
    errors: list = []
    try:
        _recording_write_errors(errors)
        _writer_started()
        rank, write_buckets, *rest = args
        write_fn(rank, _copy_views(write_buckets), *rest, **kwargs)
        if errors:
            raise errors[0]
        report.put(shard_entries(partial, write_buckets))
    except BaseException as e:
        e = _write_error(errors[0] if errors else e, partial)
        try:
            report.put(e)
        except Exception:
            report.put(RuntimeError(f"{type(e).__name__}: {e}"))


def _writer_outcome(report: PipeChannel, process) -> dict:
    """This rank's manifest entries from its writer's report, once megatron found the writer finished.

    Raises:
        the writer's reported error; :class:`CheckpointWriterDied` when it ended without a report,
        naming its pid and how it ended (the signal that killed it, or its exit status).
    """
    code = getattr(process, "exitcode", 0)
    try:
        entries = report.get_nowait()
    except queue.Empty:
        pid = getattr(process, "pid", "?")
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            how = f"was killed by {name}" + (
                " (kill -9, or the kernel's out-of-memory killer)" if name == "SIGKILL" else ""
            )
        else:
            how = f"exited with status {code} without reporting"
        raise CheckpointWriterDied(f"its background writer (pid {pid}) {how}") from None
    if isinstance(entries, BaseException):
        raise entries
    return entries


def _proc_stat(pid) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (proc(5) field 3 on); [] when the
    process is gone (or not Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _process_state(pid: int) -> str | None:
    """The one-letter state of process ``pid`` (R, S, D, T, Z, ...); None when gone."""
    fields = _proc_stat(pid)
    return fields[0] if fields else None


def in_flight_writer() -> dict | None:
    """The background writer of this process's save in flight: ``{"pid", "step", "partial", "state"}``
    (``state`` as :func:`_process_state`), or None when no writer runs. For the hang watchdog's
    heartbeat, from its thread (reads only)."""
    for saver in list(_SAVERS):
        flight = saver.in_flight
        proc = flight.get("process") if flight else None
        if proc is not None and proc.pid is not None:
            return {
                "pid": proc.pid,
                "step": flight["step"],
                "partial": str(flight["partial"]),
                "state": _process_state(proc.pid),
            }
    return None


class BackgroundSaver:
    """One rank's background saves (module docstring). ``on_commit(path, step, why, seconds)`` runs on
    every rank when a save is committed (``seconds``: from staging to commit). ``on_write_progress()``
    runs on every rank, while :meth:`wait` waits, each time the writers of all ranks together have
    written more bytes or used more CPU time than at the previous check (a hang watchdog's keep-alive: a
    write slower than a save's allowance is not a hang as long as it moves).

    Collective: :meth:`save`, :meth:`poll` and :meth:`wait` on every rank at the same step.
    """

    def __init__(
        self,
        run_dir,
        keep_last: int,
        keep_every: int | None,
        on_commit: Callable[[Path, int, str, float], None],
        on_write_progress: Callable[[], None] | None = None,
        keep_steps: Collection[int] = (),
    ):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.run_dir, self.keep_last, self.keep_every, self.on_commit = run_dir, keep_last, keep_every, on_commit
        self.on_write_progress, self.keep_steps = on_write_progress, tuple(keep_steps)
        self.queue = AsyncCallsQueue(persistent=False)  # a fresh fork per save: the snapshot
        self.in_flight: dict | None = None
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
            partial, final, request = begin_save(
                self.run_dir, step, model, optimizer, results_queue=results, writer_class=_snapshot_writer_class()
            )
        except BaseException:
            results.close(), report.close()
            raise
        if request.async_fn is not None:
            request = request._replace(
                async_fn=functools.partial(_background_writer, request.async_fn, report, partial)
            )
        else:  # nothing to write on this rank: no writer, no shards
            report.put({})

        def collect() -> None:  # first: every rank learns of a writer's failure or death on any (one line)
            flight["entries"] = agree(
                f"writing checkpoint step {step} into {partial}", lambda: _writer_outcome(report, flight.get("process"))
            )

        def commit() -> None:  # after megatron's own finalize (its metadata)
            path = commit_save(
                partial,
                final,
                step,
                flight["entries"],
                state,
                config_yaml,
                self.keep_last,
                self.keep_every,
                self.keep_steps,
            )
            self.on_commit(path, step, why, time.perf_counter() - t0)

        request.finalize_fns.insert(0, collect)
        request.add_finalize_fn(commit)
        files = [Path(b[0]) for b in request.async_fn_args[1]] if request.async_fn is not None else []
        flight = {"step": step, "partial": partial, "channels": (results, report), "files": files}
        self.in_flight = flight
        self.queue.schedule_async_request(request)
        flight["process"] = getattr(self.queue.async_calls[-1].async_caller, "process", None)

    def poll(self, blocking: bool = False) -> None:
        """Commit the save in flight when every rank's writer is done (``blocking``: wait for them).

        Raises:
            CheckpointSaveError: a writer failed (every rank raises; ``latest`` is unchanged).
        """
        if blocking:  # (polls below until the commit, keeping the hang watchdog informed)
            self._wait_for_writers()
            return
        if self.in_flight is None:
            return
        flight = self.in_flight
        try:
            with gc_paused():  # megatron's metadata and our manifest: ~10^4 small objects (see gc_paused)
                done = self.queue.maybe_finalize_async_calls(blocking=False)
        except CheckpointSaveError:
            self._forget()
            raise
        except Exception as e:  # megatron's CheckpointException: the failing rank is in its text
            self._forget()
            first = (str(e).strip().splitlines() or [""])[0]
            raise CheckpointSaveError(
                f"writing checkpoint step {flight['step']} into {flight['partial']} failed: {type(e).__name__}: {first}"
            ) from e
        if done:
            self._forget()

    def _wait_for_writers(self, interval_s: float = 1.0) -> None:
        """Collective: poll (non-blocking) until every rank's writer is done and the save is committed,
        calling ``on_write_progress`` whenever the writers moved: the bytes of their shard files or their CPU
        time grew (copying views and hashing write nothing; a writer blocked on a dead file system does
        neither)."""
        written = -1
        while self.in_flight is not None:
            self.poll(blocking=False)
            if self.in_flight is None:
                return
            local = sum(p.stat().st_size for p in self.in_flight["files"] if p.exists()) + self._writer_cpu_ticks()
            total = all_reduce_int(local, "sum")
            if total > written and self.on_write_progress is not None:
                self.on_write_progress()
            written = max(written, total)
            time.sleep(interval_s)

    def _writer_cpu_ticks(self) -> int:
        """CPU time (clock ticks, ``/proc/<pid>/stat``) of this rank's writer process; 0 when there is
        none or it is gone (or not Linux)."""
        for call in self.queue.async_calls:
            fields = _proc_stat(getattr(getattr(call.async_caller, "process", None), "pid", None))
            return int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0  # utime + stime (fields 14, 15)
        return 0

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
