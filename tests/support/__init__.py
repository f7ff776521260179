"""Test support: launching trainer ranks (fork server, forked ranks), a local Slurm, the layering
checker, scripts that wrap the trainer with an injected fault or a dump, closed-form K2 references."""

from __future__ import annotations

from pathlib import Path

from k2.parallel.processes import free_port  # noqa: F401 (the tests import it from here)

#: the repository root (tests run from a checkout; the package itself is imported as installed)
REPO = Path(__file__).resolve().parents[2]
#: trainer scripts with an injected fault or a dump (tests/support/scripts)
SCRIPTS = Path(__file__).resolve().parent / "scripts"
