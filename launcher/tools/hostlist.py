"""Slurm helpers of the batch script: the hosts of a node list and the rendezvous port of a job.

``python -m k2.launcher.tools.hostlist first-host NODELIST`` and ``... master-port JOBID`` print one line
each (``pretrain.sbatch`` uses them when ``scontrol`` is not available).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from typing import Sequence

from k2.parallel.hostlist import expand_hostlist

__all__ = ["MASTER_PORT_BASE", "MASTER_PORT_SPAN", "expand_hostlist", "first_host", "master_port"]

#: Ports derived from job ids: ``MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN`` = 20000..29999, above
#: the privileged ports (< 1024) and below Linux's ephemeral range (32768-60999, where the kernel picks
#: outgoing ports and a collision with a live connection would be possible).
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000


def first_host(nodelist: str) -> str:
    """The first host of ``nodelist`` (the rendezvous host, ``MASTER_ADDR``).

    Uses ``scontrol show hostnames`` when ``scontrol`` is on ``PATH`` and succeeds (Slurm's own order);
    otherwise :func:`expand_hostlist`.

    Raises:
        ValueError: ``nodelist`` is malformed (from :func:`expand_hostlist`).
    """
    if shutil.which("scontrol"):
        try:
            r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                               text=True, timeout=30)
            lines = r.stdout.split()
            if r.returncode == 0 and lines:
                return lines[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_hostlist(nodelist)[0]


def master_port(job_id: int) -> int:
    """The rendezvous TCP port of Slurm job ``job_id``: ``20000 + job_id % 10000`` (20000..29999).

    Deterministic, so every (re)start of a job (a requeue keeps the job id) and every node compute the
    same port without talking to each other; below Linux's ephemeral range (32768-60999) and above the
    privileged ports. Two jobs share a node and a port only when their ids are equal modulo 10000.

    Raises:
        ValueError: ``job_id`` is negative or not an integer.
    """
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 0:
        raise ValueError(f"invalid Slurm job id {job_id!r}: must be an integer >= 0")
    return MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN


def _module_main(argv: Sequence[str]) -> int:
    """``python -m k2.launcher.tools.hostlist first-host NODELIST | master-port JOBID``: one line on stdout; exit 2
    with ``k2.launcher.tools.hostlist: error: ...`` on bad arguments."""
    usage = "usage: python -m k2.launcher.tools.hostlist first-host NODELIST | master-port JOBID"
    if len(argv) != 2 or argv[0] not in ("first-host", "master-port"):
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] == "first-host":
            print(first_host(argv[1]))
        else:
            if not re.fullmatch(r"\d+", argv[1].strip()):
                raise ValueError(f"invalid Slurm job id {argv[1]!r}: must be an integer >= 0")
            print(master_port(int(argv[1])))
    except ValueError as e:
        print(f"k2.launcher.tools.hostlist: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_module_main(sys.argv[1:]))
