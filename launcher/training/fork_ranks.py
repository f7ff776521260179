"""Local ranks forked from one process that has imported the trainer once: what ``k2-train`` runs to
start ``launch.nproc_per_node`` ranks on one machine (:func:`k2.launcher.training.launch.spawn_local_ranks`).

Why not torchrun's fresh interpreters: importing torch + megatron-core + the trainer costs ~8 s of CPU
per process, paid by every rank of every launch (a 4-rank CPU run spends most of its start-up there;
an 8-GPU node pays it 8 times). Forked ranks share one import. Each rank of ``k2-train`` calls
``k2.launcher.train.rank_main`` with the config and plan ``k2-train`` composed (a :class:`Call`: nothing
is composed again); a module or script runs as under ``python``. Either way each rank gets the
environment contract torchrun gives it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``);
the ranks rendezvous over TCP as before. Fork safety: this process only imports (no thread, no CUDA
context, no OpenMP pool exists when it forks; :func:`preimport` checks the first two), so each rank
starts from a clean runtime and initialises CUDA / gloo / NCCL itself. "No CUDA" includes the driver:
several imports ask ``torch.cuda.is_available()`` (megatron-core's ``strategies/torch.py``, torch's
``cpp_extension``), whose ``cudaGetDeviceCount`` runs ``cuInit``
without setting torch's lazy-init flag, and CUDA in a child forked after ``cuInit`` fails
("initialization error"); so the imports run with :func:`cuda_probe_without_init`. Multi-node runs do not come here:
there srun (or torchrun) starts one process per rank.

Like torchrun: SIGTERM / SIGINT / SIGUSR1 sent to this process reach every rank; when a rank fails, the
others get SIGTERM (SIGKILL 30 s later), and first a line naming the failed rank in the file that
``$K2_PEER_FAILED_FILE`` names in their environment
(:func:`k2.launcher.training.preemption.peer_failure`: so that they can tell that SIGTERM from a
preemption's); the exit status is the first failed rank's (so ``k2-train``
passes a rank's own status on: 2 for a bad setting, 3 for divergence), 0 when all succeed. Every rank
gets SIGKILL when this process dies (``PR_SET_PDEATHSIG``).

Usage: ``python -m k2.launcher.training.fork_ranks NPROC [--master-port=PORT] (-m MODULE | -c CODE |
SCRIPT) [ARGS...]`` or ``... NPROC [--master-port=PORT] --call-fd=FD`` (each rank calls the function
pickled, with its arguments, into the inherited pipe FD: :class:`Call`); a free port on 127.0.0.1 when none
is given.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from k2.launcher.gc_pause import gc_paused
from k2.launcher.training.preemption import PEER_FAILED_ENV
from k2.parallel.processes import die_with_parent, free_port
from k2.parallel.rendezvous import LISTEN_FD_ENV

__all__ = [
    "cuda_probe_without_init",
    "freeze_imported_objects",
    "imports_without_collection",
    "launch",
    "main",
    "preimport",
]

#: the trainer's module: ranks started as ``-m k2.launcher.train`` (torchrun-like) get its config composed
#: once, before the fork
TRAINER_MODULE = "k2.launcher.train"
#: seconds between SIGTERM and SIGKILL for the other ranks of a failed launch (torchrun's default)
STOP_GRACE_S = 30.0


def preimport() -> None:
    """Import what every rank imports first (torch, megatron-core, the trainer), once, before forking.

    Raises:
        RuntimeError: an import started a thread or initialised CUDA (forking would then be unsafe).
    """
    import warnings

    with imports_without_collection(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch

        with cuda_probe_without_init():  # (module docstring: no cuInit before the fork)
            # torch.optim's optimizers import torch._dynamo on their first construction (torch._compile's
            # _disable_dynamo): imported here it is shared by the ranks instead of costing each ~0.5-0.8 s of CPU
            import hydra.compose  # noqa: F401
            import megatron.core.datasets.blended_megatron_dataset_builder
            import megatron.core.datasets.gpt_dataset
            import megatron.core.dist_checkpointing
            import megatron.core.dist_checkpointing.strategies.fully_parallel
            import megatron.core.models.gpt
            import megatron.core.models.gpt.gpt_layer_specs
            import megatron.core.optimizer
            import megatron.core.pipeline_parallel  # noqa: F401
            import tokenizers  # noqa: F401
            import torch._dynamo

            import k2.launcher.training.trainer  # noqa: F401
    if torch.cuda.is_initialized():  # (not is_available(): its own driver call is what must not happen)
        raise RuntimeError("fork_ranks: CUDA was initialised before the ranks were forked")
    extra = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if extra:
        raise RuntimeError(f"fork_ranks: threads running before the ranks were forked: {extra}")


def _gpus_without_cuda() -> int:
    """How many GPUs this machine has, asked without initialising CUDA: NVML (torch's own
    ``_device_count_nvml``, which honours ``CUDA_VISIBLE_DEVICES``), else the NVIDIA driver's
    ``/proc/driver/nvidia/gpus`` entries (no NVML library, or MIG devices NVML is not asked about), else 0."""
    import torch

    n = torch.cuda._device_count_nvml()
    if n >= 0:
        return n
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


@contextlib.contextmanager
def cuda_probe_without_init():
    """While inside, torch's CUDA availability check (``torch.cuda.is_available``, and ``device_count``
    where NVML fails) answers from :func:`_gpus_without_cuda` instead of ``cudaGetDeviceCount``, which
    runs ``cuInit`` in this process (torch's ``is_available`` docstring; the fork-poisoning note of
    torch.multiprocessing). A process that forks CUDA-using children must not have run ``cuInit``, and
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` alone does not avoid it: without NVML torch falls back to the driver
    call. The answer is what the ranks will find (same devices, same ``CUDA_VISIBLE_DEVICES``), so
    import-time decisions taken here (megatron's ``HAVE_TE``) hold in them; the
    real call is back in place when the block ends. Only for a process that imports and forks."""
    import torch

    real = getattr(torch._C, "_cuda_getDeviceCount", None)
    if real is None:  # a torch built without CUDA: nothing can initialise it
        yield
        return
    torch._C._cuda_getDeviceCount = _gpus_without_cuda
    try:
        yield
    finally:
        torch._C._cuda_getDeviceCount = real


@contextlib.contextmanager
def imports_without_collection():
    """Run the heavy imports (torch, megatron-core, the trainer) with the garbage collector off, then
    freeze what is alive (:func:`freeze_imported_objects`). The imports make ~350k objects that live for
    the whole process; the full collections they would trigger on the way rescan them again and again
    (~0.8 s of CPU per process on a 2-core EPYC)."""
    with gc_paused():
        try:
            yield
        finally:
            freeze_imported_objects()


def freeze_imported_objects() -> None:
    """Move every object alive now (the imported modules: ~350k objects) out of the garbage
    collector's reach (``gc.freeze``, the use its documentation gives for a process that forks workers):
    each rank's full collections then scan only what the rank made (a full collection of the imported
    objects costs ~0.25 s of CPU on a 2-core EPYC) and do not write to the shared pages (fewer
    copy-on-write faults). Collected objects and results are unchanged; only imports are frozen, so
    nothing the run creates is kept alive."""
    import gc

    gc.collect()  # (the garbage of the imports first: frozen, it would stay for the process's life)
    gc.freeze()


@dataclass(frozen=True)
class Call:
    """A function each rank calls, with arguments made once by the process that asked for the launch
    (``k2-train``: its composed config and plan) and inherited by the ranks through the fork.

    Attributes:
        fn: a module-level function (so that it can be pickled by name) returning the rank's exit status.
        args: its positional arguments.
    """

    fn: Callable[..., int]
    args: tuple = ()

    @classmethod
    def receive(cls, fd: int) -> Call:
        """The ``(fn, args)`` pickle read to its end from the pipe ``fd`` this process inherited from its
        parent (:func:`k2.launcher.training.launch.spawn_local_ranks`, the same user's process); ``fd`` is
        closed.

        Raises:
            EOFError, pickle.UnpicklingError: the parent died before it wrote the whole call.
        """
        import pickle

        with os.fdopen(fd, "rb") as pipe:
            fn, args = pickle.loads(pipe.read())
        return cls(fn, tuple(args))


#: what :func:`launch` runs in each rank
Target = list | Call


def _run_rank(rank: int, nproc: int, port: int, target: Target, rank_env: bool) -> int:
    """Run ``target`` in this forked process: a :class:`Call`, or as ``python`` would (``-m MODULE``,
    ``-c CODE`` or ``SCRIPT``); returns its exit status."""
    import runpy

    if rank_env:
        os.environ.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
    if isinstance(target, Call):
        runner = lambda: sys.exit(target.fn(*target.args))  # noqa: E731
    elif target[0] == "-c":
        sys.argv = ["-c", *target[2:]]
        sys.path[0] = ""
        runner = lambda: exec(compile(target[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: E731
    elif target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        # runs the module afresh as __main__, as python -m does (its imports stay loaded); the preimported
        # copy is dropped first, else runpy warns that the module was found in sys.modules
        sys.modules.pop(target[1], None)
        runner = lambda: runpy.run_module(target[1], run_name="__main__", alter_sys=True)  # noqa: E731
    else:  # (python SCRIPT puts the script's directory first on sys.path, python -m the cwd)
        sys.argv = list(target)
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
        runner = lambda: runpy.run_path(target[0], run_name="__main__")  # noqa: E731
    try:
        runner()
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    return 0


def _rendezvous_target(target: Target) -> bool:
    """Whether ``target`` is the trainer (k2-train's :class:`Call`, or ``-m k2.launcher.train``), whose ranks
    meet through :func:`k2.parallel.rendezvous.rendezvous` and take the listening socket; other targets may
    bind ``MASTER_PORT`` themselves (``env://``), which a held socket would refuse."""
    return isinstance(target, Call) or target[:2] == ["-m", TRAINER_MODULE]


def _signal_all(pids, signum: int) -> None:
    for pid in list(pids):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def launch(
    nproc: int, target: Target, port: int | None = None, watch: socket.socket | None = None, rank_env: bool = True
) -> int:
    """Fork ``nproc`` ranks of ``target`` from this process and wait for them (module docstring).

    Args:
        nproc: ranks to start (>= 1).
        target: ``["-m", MODULE, *args]``, ``["-c", CODE, *args]``, ``[SCRIPT, *args]`` or a :class:`Call`
            (each rank calls it, inheriting its arguments through the fork).
        port: ``MASTER_PORT`` on 127.0.0.1; a free one when None (chosen after the imports: less time
            for another process to take it).
        watch: a connected socket whose peer going away (EOF) kills every rank and returns 1 (a process
            that asked for this launch over the socket died).
        rank_env: give each rank torchrun's environment; False runs one plain process, as ``python -m``.

    While it waits, SIGTERM / SIGINT / SIGUSR1 sent to this process go to every rank (the previous
    handlers are restored on return).

    Returns:
        the first failed rank's exit status (128 + N for a rank killed by signal N), 0 when all succeed.
    """
    if (
        not isinstance(target, Call)
        and target[:2] == ["-m", TRAINER_MODULE]
        and not set(target[2:]) & {"-m", "--multirun"}
    ):
        from k2.config import ConfigError, load_config

        try:  # once here, not once per rank: the forked ranks find it in load_config's cache
            load_config(target[2:])
        except ConfigError:
            pass  # each rank reports it as usual
    listen = None
    if port is None and rank_env and nproc > 1 and _rendezvous_target(target):
        # the trainer's rank 0 serves its store on a socket bound here and inherited through the fork: no
        # other process can take the port between its choice and rank 0's bind (k2.parallel.rendezvous)
        listen = socket.create_server(("127.0.0.1", 0), backlog=128)
        port = listen.getsockname()[1]
    # else the port last, right before the fork: the less time between releasing it and rank 0's bind,
    # the less chance another process takes it (an ephemeral port: any new connection on the host may)
    port = port or free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    failed = Path(tempfile.gettempdir()) / f"k2-ranks-{os.getpid()}-{port}.failed"
    failed.unlink(missing_ok=True)
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:  # the rank
            os.environ[PEER_FAILED_ENV] = str(failed)
            if listen is not None:
                os.environ[LISTEN_FD_ENV] = str(listen.fileno())
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                signal.signal(sig, signal.SIG_DFL)
            die_with_parent()
            code = 1
            try:
                code = _run_rank(rank, nproc, port, target, rank_env)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    if listen is not None:
        listen.close()  # (rank 0 holds its copy)

    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # as under torchrun: every rank gets them
    previous = {sig: signal.signal(sig, lambda signum, _frame: _signal_all(children, signum)) for sig in forwarded}
    try:
        return _wait(children, watch, failed)
    finally:
        failed.unlink(missing_ok=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(children: dict[int, int], watch: socket.socket | None, failed: Path) -> int:
    """Reap ``children`` (pid -> rank); the status rules of :func:`launch`; ``failed``: the file of
    :func:`k2.launcher.training.preemption.peer_failure`."""
    status, deadline = 0, None
    while children:
        if watch is not None and select.select([watch], [], [], 0)[0] and not watch.recv(1, socket.MSG_PEEK):
            _signal_all(children, signal.SIGKILL)
            watch, status, deadline = None, status or 1, float("inf")
        if deadline is not None and time.time() > deadline:
            _signal_all(children, signal.SIGKILL)
            deadline = float("inf")
        polling = deadline is not None or watch is not None
        pid, raw = os.waitpid(-1, os.WNOHANG) if polling else os.waitpid(-1, 0)
        if pid == 0:
            time.sleep(0.05)
            continue
        rank = children.pop(pid, None)
        code = os.waitstatus_to_exitcode(raw)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            why = (
                f"was killed by signal {-code} ({signal.Signals(-code).name})"
                if code < 0
                else f"exited with status {code}"
            )
            try:
                failed.write_text(f"rank {rank} {why}\n")
            except OSError:
                pass  # the others then report a plain SIGTERM
            if code < 0:  # killed by a signal: the rank itself could say nothing (the others' SIGTERM
                # line below is the launcher stopping them, not a preemption; the step in progress is lost)
                print(
                    f"k2-train: rank {rank} was killed by signal {-code} ({signal.Signals(-code).name}); "
                    f"stopping the other ranks (SIGTERM, SIGKILL after {STOP_GRACE_S:g} s): the step in "
                    "progress is not saved",
                    file=sys.stderr,
                    flush=True,
                )
            _signal_all(children, signal.SIGTERM)  # the other ranks of a failed group stop
            deadline = time.time() + STOP_GRACE_S
    return status


def main(argv: list[str]) -> int:
    """The command line of the module docstring; returns the exit status."""
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        print(__doc__.rsplit("Usage: ", 1)[1].strip(), file=sys.stderr)
        return 2
    nproc, rest, port = int(argv[0]), argv[1:], None
    if rest and rest[0].startswith("--master-port="):
        port, rest = int(rest[0].split("=", 1)[1]), rest[1:]
    sys.path[0] = os.getcwd()  # as under python -m: the working directory first
    try:
        preimport()
        call = (
            Call.receive(int(rest[0].split("=", 1)[1])) if len(rest) == 1 and rest[0].startswith("--call-fd=") else None
        )
    except KeyboardInterrupt:  # Ctrl-C before any rank exists: nothing to stop (k2-train says what is kept)
        return 130
    return launch(nproc, call if call is not None else rest, port=port)


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # the ranks are reaped and their output is written: skip the interpreter's teardown of torch and
    # megatron-core (~2 s of CPU measured on a 2-core EPYC: collecting every module's objects, torch's
    # operator-library finalizers), as each forked rank does (os._exit above)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
