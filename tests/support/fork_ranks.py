"""Start N gloo ranks of the trainer by forking one process that has already imported torch and
megatron-core, instead of torchrun's N fresh interpreters.

Why (tests only): importing torch + megatron-core costs ~7.5 s of CPU per process (torch's custom-op
registrations alone ~2.7 s), three quarters of a 4-rank test run on CI's 2 cores. Forked ranks share the
parent's imported modules, so a 4-rank run pays for one import instead of four. What each rank runs is
unchanged: the same module (``k2.launcher.train``) or test script, with the environment contract torchrun
gives it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) -- the ranks still
rendezvous over TCP and train on gloo with megatron's real schedules, optimizer and checkpointing.
Launching itself (k2-train's torchrun spawn, signal forwarding, Slurm) is tested with the real torchrun
in the tests that are about it (test_train_run.py, test_checkpoint.py's k2-train signal tests,
test_slurm_real.py).

Like torchrun: when a rank fails, the others get SIGTERM (SIGKILL 30 s later); the exit status is the
first failed rank's, 0 when all succeed.

Usage: python tests/support/fork_ranks.py NPROC (-m MODULE | -c CODE | SCRIPT) [ARGS...]; the fork server
(tests/support/zygote.py) calls :func:`launch` in a process that imported everything once per session.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _preimport() -> None:
    # what every rank imports first; nothing here may start a thread or touch the network (fork safety)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.dist_checkpointing  # noqa: F401


def _die_with_parent() -> None:
    """Linux: the rank gets SIGKILL when the launcher dies (e.g. killed by a test's timeout)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_rank(rank: int, nproc: int, port: int, target: list[str], rank_env: bool = True) -> int:
    import runpy

    if rank_env:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    if target[0] == "-c":  # python -c CODE
        sys.argv = ["-c", *target[2:]]
        sys.path[0] = ""
        runner = lambda: exec(compile(target[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: E731
    elif target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runner = lambda: runpy.run_module(target[1], run_name="__main__", alter_sys=True)  # noqa: E731
    else:  # (python SCRIPT puts the script's directory first on sys.path, python -m the cwd)
        sys.argv = list(target)
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
        runner = lambda: runpy.run_path(target[0], run_name="__main__")  # noqa: E731
    try:
        runner()
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0


def _signal_all(pids, signum: int) -> None:
    for pid in list(pids):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def launch(nproc: int, target: list[str], watch=None, rank_env: bool = True) -> int:
    """Fork ``nproc`` ranks of ``target`` from this process (which has imported what they need) and wait
    for them, like torchrun: the exit status is the first failed rank's, 0 when all succeed.

    Args:
        watch: an optional socket; when its peer goes away (EOF), every rank is killed and 1 returned
            (the fork server's client was killed, e.g. by a test's timeout).
        rank_env: give each rank torchrun's environment (RANK, WORLD_SIZE, MASTER_*); False runs one
            plain process, as ``python -m MODULE`` would.
    """
    import select
    import socket

    with socket.socket() as sock:  # the master port, chosen after the imports (less time for a clash)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:  # the rank
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _die_with_parent()
            code = 1
            try:
                code = _run_rank(rank, nproc, port, target, rank_env)
            except BaseException:  # noqa: BLE001 - report and exit like an uncaught exception would
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):  # like torchrun: they reach every rank
        signal.signal(sig, lambda signum, _frame: _signal_all(children, signum))
    status, deadline = 0, None
    while children:
        if watch is not None and select.select([watch], [], [], 0)[0] and not watch.recv(1, socket.MSG_PEEK):
            _signal_all(children, signal.SIGKILL)  # the client is gone
            watch, status, deadline = None, status or 1, float("inf")
        if deadline is not None and time.time() > deadline:
            _signal_all(children, signal.SIGKILL)
            deadline = float("inf")
        pid, raw = os.waitpid(-1, os.WNOHANG) if (deadline is not None or watch is not None) else os.waitpid(-1, 0)
        if pid == 0:
            time.sleep(0.05)
            continue
        children.pop(pid, None)
        code = os.waitstatus_to_exitcode(raw)
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            _signal_all(children, signal.SIGTERM)  # torchrun stops the other ranks of a failed group
            deadline = time.time() + 30
    return status


def main(argv: list[str]) -> int:
    nproc, target = int(argv[0]), argv[1:]
    sys.path[0] = os.getcwd()  # as under python -m: the repository (cwd), not tests/, comes first
    _preimport()
    return launch(nproc, target)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
