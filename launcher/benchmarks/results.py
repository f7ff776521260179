"""A benchmark's results file, written by the benchmark itself: ``benchmarks/results/<bench>_<cpu>_<UTC time>.json``.

A file under ``benchmarks/results/`` is a measurement's record, so no figure in it is typed by hand: the
benchmark that measured it writes it, with what a reader needs to redo or doubt it -- the command, the
code's git commit, the machine (:func:`k2.launcher.benchmarks.common.system_info`: torch, megatron-core,
the CPU's model name), the options, the profiles it predicted with, every raw timing and the derived
figures. The file appears only once the run is complete: it is written to a temporary name in the same
directory and renamed over (``os.replace``, atomic on POSIX), so a failed, killed or hung run leaves no file
that looks complete.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["RESULTS_DIR", "results_record", "write_results"]

#: where the benchmarks' results files live (relative paths are taken from the repository root)
RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _git_head(cwd: Path) -> str | None:
    """The commit of the code that ran (``git rev-parse HEAD``), with ``+dirty`` when the tree has changes;
    None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def results_record(
    bench: str,
    options: dict[str, Any],
    figures: dict[str, Any],
    *,
    now: datetime.datetime | None = None,
    argv: list[str] | None = None,
) -> dict[str, Any]:
    """The record a results file holds: ``bench``, ``utc`` (ISO time the run ended), ``command`` (the argv),
    ``head`` (git commit), ``system`` (:func:`k2.launcher.benchmarks.common.system_info`), ``options`` and
    the benchmark's ``figures`` (its raw timings and derived figures, as it returns them)."""
    from k2.launcher.benchmarks.common import system_info

    now = now or datetime.datetime.now(datetime.UTC)
    return {
        "bench": bench,
        "utc": now.isoformat(timespec="seconds"),
        "command": " ".join(argv if argv is not None else sys.argv),
        "head": _git_head(Path(__file__).resolve().parent),
        "system": system_info(),
        "options": options,
        "figures": figures,
    }


def _slug(text: str) -> str:
    """A file-name piece of a CPU's model name: ``Intel(R) Xeon(R) Platinum 8480+`` -> ``xeon-platinum-8480``."""
    words = re.sub(r"\([^)]*\)|cpu|processor|@.*", " ", text.lower())
    return "-".join(re.findall(r"[a-z0-9]+", words))[:40] or "cpu"


def write_results(record: dict[str, Any], directory: str | Path = RESULTS_DIR) -> Path:
    """Write ``record`` (:func:`results_record`) as ``<bench>_<cpu>_<UTC time>.json`` under ``directory``
    (made if missing), atomically (module docstring). Returns the path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    when = record["utc"].replace(":", "").replace("-", "")[:15]
    path = directory / f"{record['bench']}_{_slug(str(record['system'].get('cpu', '')))}_{when}.json"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
