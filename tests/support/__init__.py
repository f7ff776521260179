"""Test support: launching trainer ranks (fork server, forked ranks), a local Slurm, the layering
checker, scripts that wrap the trainer with an injected fault or a dump, closed-form K2 references."""

from __future__ import annotations

import socket
from pathlib import Path

#: the repository root (tests run from a checkout; the package itself is imported as installed)
REPO = Path(__file__).resolve().parents[2]
#: trainer scripts with an injected fault or a dump (tests/support/scripts)
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
