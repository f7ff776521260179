"""Client of the test session's fork server (tests/support/zygote.py): runs one trainer launch there as
if this process ran it. Usage: python zygote_client.py SOCKET NPROC (-m MODULE | SCRIPT) [ARGS...].
It imports nothing heavy (it starts in milliseconds) and exits with the launch's exit status."""

import json
import os
import signal
import socket
import sys


def main(argv: list[str]) -> int:
    path, nproc, target = argv[0], int(argv[1]), argv[2:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = json.dumps({"nproc": nproc, "target": target, "cwd": os.getcwd(), "env": dict(os.environ)})
    socket.send_fds(conn, [request.encode() + b"\n"], [0, 1, 2])
    reader = conn.makefile("r")
    first = reader.readline().split()
    if len(first) != 2 or first[0] != "pid":
        return 1
    launcher = int(first[1])

    def forward(signum, _frame):
        try:
            os.kill(launcher, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    for line in reader:
        word, _, value = line.strip().partition(" ")
        if word == "exit":
            return int(value)
    return 1  # the launcher died without reporting


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
