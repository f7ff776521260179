"""Slurm's hostlist expressions (``SLURM_JOB_NODELIST``: ``gpu[008-010],x``) expanded into host names.

Written here rather than taken from a library: the Python packages that parse hostlists
(python-hostlist) are not dependencies of megatron-core or torch, and the grammar Slurm documents is
small; ``scontrol show hostnames`` does the same where Slurm's client commands exist (the batch script
prefers it).
"""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_hostlist"]


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
            raise ValueError(
                f"invalid hostlist {original!r}: bracket item {part!r} is not N or N-M (digits)"
            )
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
