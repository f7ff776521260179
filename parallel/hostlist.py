"""Slurm's hostlist expressions (``SLURM_JOB_NODELIST``: ``gpu[008-010],x``) expanded into host names, the
rendezvous host of a node list and the rendezvous port of a job.

``python -m k2.parallel.hostlist first-host NODELIST`` and ``... master-port JOBID`` print one line
each (``pretrain.sbatch`` uses them when ``scontrol`` is not available).

Written here rather than taken from a library: the Python packages that parse hostlists
(python-hostlist) are not dependencies of megatron-core or torch, and the grammar Slurm documents is
small; ``scontrol show hostnames`` does the same where Slurm's client commands exist (the batch script
prefers it).
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["MASTER_PORT_BASE", "MASTER_PORT_SPAN", "expand_hostlist", "first_host", "master_port"]

#: Ports derived from job ids: ``MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN`` = 20000..29999, above
#: the privileged ports (< 1024) and below Linux's ephemeral range (32768-60999, where the kernel picks
#: outgoing ports and a collision with a live connection would be possible).
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000


def _split_top_level(s: str, original: str) -> list[str]:
    """``s`` split on commas outside brackets; raises ValueError on unbalanced or nested brackets."""
    items, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            if depth:
                raise ValueError(f"invalid hostlist {original!r}: nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"invalid hostlist {original!r}: ']' without '['")
            depth = 0
        if ch == "," and not depth:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"invalid hostlist {original!r}: '[' without ']'")
    items.append("".join(cur))
    return items


def _expand_brackets(body: str, original: str) -> list[str]:
    """The numbers of one bracket group (``"001,003"``, ``"01-03,7"``) as strings, padding kept."""
    out: list[str] = []
    for part in body.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"invalid hostlist {original!r}: bracket item {part!r} is not N or N-M (digits)")
        lo_s, hi_s = m.group(1), m.group(2)
        if hi_s is None:
            out.append(lo_s)
            continue
        lo, hi = int(lo_s), int(hi_s)
        if lo > hi:
            raise ValueError(f"invalid hostlist {original!r}: reversed range {part!r}")
        width = len(lo_s)  # Slurm keeps the zero padding of the range's start: [008-010]
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def expand_hostlist(s: str) -> list[str]:
    """Expand a Slurm hostlist expression (``SLURM_JOB_NODELIST``) into host names, in order.

    Grammar (Slurm's hostlist format): items separated by commas outside brackets; an item is a name
    with zero or more bracket groups ``[a,b-c,...]`` of decimal numbers and ranges. A range keeps the
    zero padding of its start (``gpu[008-010]`` -> gpu008, gpu009, gpu010); several groups in one name
    expand as a cartesian product, the last group varying fastest (``rack[0-1]_blade[0-1]`` -> rack0_blade0,
    rack0_blade1, rack1_blade0, rack1_blade1). Duplicates are kept.

    Args:
        s: e.g. ``"nodeA,nodeB[001,003],nodeC"``.

    Returns:
        Host names, e.g. ``["nodeA", "nodeB001", "nodeB003", "nodeC"]``.

    Raises:
        ValueError: empty input or an empty item, unbalanced or nested brackets, an empty bracket group,
            a bracket item that is not ``N`` / ``N-M`` or a reversed range ``M-N`` with ``M > N``; the
            message names the input.
    """
    if not isinstance(s, str) or not s.strip():
        raise ValueError(f"invalid hostlist {s!r}: empty")
    hosts: list[str] = []
    for item in _split_top_level(s.strip(), s):
        item = item.strip()
        if not item:
            raise ValueError(f"invalid hostlist {s!r}: empty item")
        choices: list[list[str]] = []
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", item):
            if literal:
                choices.append([literal])
            if body:
                choices.append(_expand_brackets(body, s))
        if re.search(r"\[\s*\]", item):
            raise ValueError(f"invalid hostlist {s!r}: empty brackets in {item!r}")
        hosts.extend("".join(p) for p in itertools.product(*choices))
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of ``nodelist`` (the rendezvous host, ``MASTER_ADDR``).

    Uses ``scontrol show hostnames`` when ``scontrol`` is on ``PATH`` and succeeds (Slurm's own order);
    otherwise :func:`expand_hostlist`.

    Raises:
        ValueError: ``nodelist`` is malformed (from :func:`expand_hostlist`).
    """
    if shutil.which("scontrol"):
        try:
            r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
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
    """``python -m k2.parallel.hostlist first-host NODELIST | master-port JOBID``: one line on stdout; exit 2
    with ``k2.parallel.hostlist: error: ...`` on bad arguments."""
    usage = "usage: python -m k2.parallel.hostlist first-host NODELIST | master-port JOBID"
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
        print(f"k2.parallel.hostlist: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_module_main(sys.argv[1:]))
