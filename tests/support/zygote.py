"""A fork server for the test session: one process imports torch, megatron-core and k2-launcher once,
then forks every trainer launch of the tests (:func:`serve`); a launch is a tiny client process
(``zygote_client.py``) that costs no import.

Why (tests only): importing torch + megatron-core costs ~7.5 s of CPU per interpreter. k2-train's rank
launcher (k2.launcher.training.fork_ranks) already shares that import among the ranks of one launch; the
fork server shares it
among all the launches of the session (about 40). What runs is unchanged: the client hands the server
its command (nproc, ``-m MODULE`` or a script, arguments), working directory, environment and its stdin /
stdout / stderr (file descriptors passed over a Unix socket); the server forks a launcher that takes
them over and forks the ranks exactly as k2-train's launcher does (:func:`fork_ranks.launch`). The client
exits with the launcher's exit status; SIGTERM / SIGINT / SIGUSR1 sent to the client reach the ranks;
when the client dies (a test's timeout), the launcher kills its ranks.

The session fixture in tests/conftest.py starts the server (``python zygote.py SOCKET``) and stops it at
the end; ``K2_TEST_LAUNCHER=fork`` (forked ranks per launch, no server) or ``torchrun`` bypass it.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

from k2.launcher.training import fork_ranks

_SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _preimport() -> None:
    # nothing here may start a thread or touch the network (the server forks afterwards)
    import warnings

    fork_ranks.preimport()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import k2.launcher.benchmarks.step
        import k2.launcher.train
        import k2.launcher.training.trainer  # noqa: F401
    fork_ranks.freeze_imported_objects()  # (again: the imports above came after preimport's)


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    buf, fds = b"", []
    while not buf.endswith(b"\n"):
        data, ancdata, _flags, _addr = conn.recvmsg(1 << 20, socket.CMSG_LEN(3 * array.array("i").itemsize))
        if not data:
            raise ConnectionError("client closed before sending its request")
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[: len(payload) - (len(payload) % a.itemsize)])
                fds += list(a)
        buf += data
    return json.loads(buf), fds


#: the test scripts (tests/support/scripts) whose arguments are not Hydra overrides
_NOT_CONFIG_SCRIPTS = {"max_logit_kernel_cases.py", "rank_function.py"}
#: in a launch's environment: a JSON list of further override lists that each of its ranks composes (e.g.
#: the cases of tests/support/scripts/measure_saved_bytes.py), composed once before the fork as well
PRECOMPOSE_ENV = "K2_TEST_PRECOMPOSE"


def _compose_script_config(target: list[str]) -> None:
    """A test script of tests/support/scripts composes its arguments as the config (most wrap
    ``k2.launcher.train.main``), and maybe the configs of :data:`PRECOMPOSE_ENV`: composed once here,
    before the fork, each rank finds them in ``load_config``'s cache instead of composing them again
    (~0.25 s of CPU per rank and config), as :func:`fork_ranks.launch` does for ``-m k2.launcher.train``."""
    from k2.config import ConfigError, load_config

    script = Path(target[0])
    if script.parent.resolve() != _SCRIPTS or script.name in _NOT_CONFIG_SCRIPTS:
        return
    for overrides in [target[1:], *json.loads(os.environ.get(PRECOMPOSE_ENV, "[]"))]:
        try:
            load_config(overrides)
        except ConfigError:
            pass  # each rank reports it as usual


def _launcher(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked launcher: become the client's process (stdio, cwd, environment), run the ranks,
    report the exit status; never returns."""
    code = 1
    try:
        for target_fd, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target_fd)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # as under python -m: the working directory first
        conn.sendall(f"pid {os.getpid()}\n".encode())
        nproc = int(request["nproc"])
        if nproc > 1:
            _compose_script_config(request["target"])
        code = fork_ranks.launch(max(1, nproc), request["target"], watch=conn, rank_env=nproc > 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.sendall(f"exit {code}\n".encode())
        except OSError:
            pass
        os._exit(code)


def serve(path: str) -> None:
    """Import everything, then fork one launcher per client connection on the Unix socket ``path``
    until SIGTERM."""
    _preimport()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    launchers: set[int] = set()
    running = True

    def stop(_signum, _frame):
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    try:  # (an error in the loop still stops every launcher and removes the socket)
        while running:
            try:
                ready = select.select([server], [], [], 0.5)[0]
            except InterruptedError:
                continue
            while launchers:  # reap the launchers that finished
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                launchers.discard(pid)
            if not ready:
                continue
            conn, _ = server.accept()
            try:
                request, fds = _recv_request(conn)
            except (ConnectionError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:  # the launcher: never back into this loop or its cleanup (os._exit)
                try:
                    server.close()
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.SIG_DFL)
                    _launcher(conn, request, fds)
                finally:
                    os._exit(1)
            launchers.add(pid)
            for fd in fds:
                os.close(fd)
            conn.close()
    finally:
        for pid in launchers:  # the session is over: nothing it started may outlive it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.close()
        os.unlink(path)


if __name__ == "__main__":
    serve(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # (the session is over: skip the ~2 CPU-s teardown of torch and megatron-core)
