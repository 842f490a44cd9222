"""Slurm's compact notations: node lists, tasks per node, and the port of a job.

Slurm hands every task its allocation in compressed strings::

    SLURM_JOB_NODELIST=rack[1-2]-node[01-02],login3
    SLURM_TASKS_PER_NODE=4(x2),2

``parse_nodelist`` and ``parse_tasks_per_node`` expand them in pure Python (so the code
runs, and is tested, where Slurm is not installed); ``hostnames`` prefers
``scontrol show hostnames`` when it is on PATH, since Slurm itself is the authority.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
DEFAULT_PORT_BASE = 20000  # job ports land in 20000..39999: above the well-known ports,
DEFAULT_PORT_SPAN = 20000  # below Linux's ephemeral range (32768+ overlaps; collisions are rare)


def _split_top_level(nodelist: str) -> list[str]:
    """Split on the commas that are outside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            if depth:
                raise ValueError(f"bad Slurm nodelist {nodelist!r}: nested '[' at position {i}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(
                    f"bad Slurm nodelist {nodelist!r}: ']' without '[' at position {i}"
                )
            depth = 0
        elif ch == "," and not depth:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"bad Slurm nodelist {nodelist!r}: '[' is never closed")
    items.append(nodelist[start:])
    return items


def _expand_group(group: str, item: str) -> list[str]:
    """``01-03,07`` -> ``01 02 03 07``; the width of the low bound is kept (zero padding)."""
    values = []
    for part in group.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(
                f"bad Slurm nodelist item {item!r}: {part!r} is not a number or a range like 01-03"
            )
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"bad Slurm nodelist item {item!r}: range {part!r} goes backwards")
        values.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return values


def _expand_item(item: str) -> list[str]:
    """One host expression, any number of bracket groups: ``rack[1-2]-node[01-02]``.

    The leftmost group varies slowest, as ``scontrol show hostnames`` prints them.
    """
    if not item.strip():
        raise ValueError(
            "empty host name in Slurm nodelist (two commas in a row, or a trailing comma)"
        )
    pieces: list[list[str]] = []
    for token in re.split(r"(\[[^\]]*\])", item):  # brackets are balanced: checked by the caller
        if token.startswith("["):
            if not token[1:-1].strip():
                raise ValueError(f"bad Slurm nodelist item {item!r}: empty brackets '[]'")
            pieces.append(_expand_group(token[1:-1], item))
        elif token:
            pieces.append([token])
    return ["".join(parts) for parts in itertools.product(*pieces)]


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list into host names, in Slurm's order.

    Forms: ``node01``; ``node[01-03,07]`` (zero padding kept); ``a[1-2],b3`` (several items);
    ``rack[1-2]-node[01-02]`` (several bracket groups); ``gpu[1-2]-ib`` (text after brackets).
    Raises ``ValueError`` naming the bad part.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("empty Slurm nodelist: SLURM_JOB_NODELIST / SLURM_NODELIST has no host")
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_item(item.strip()))
    return hosts


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE``: ``4(x2),2`` -> ``[4, 4, 2]`` (one entry per node)."""
    counts: list[int] = []
    for part in spec.split(","):
        m = _TASKS.match(part.strip())
        if not m:
            raise ValueError(
                f"bad Slurm tasks-per-node {spec!r}: {part!r} is not like '4' or '4(x2)'"
            )
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def hostnames(nodelist: str) -> list[str]:
    """Host names of a node list: ``scontrol show hostnames`` if available, else our parser.

    scontrol knows site-specific forms the parser may not; if it fails we fall back rather
    than stop a job that the parser understands.
    """
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass
    return parse_nodelist(nodelist)


def job_port(job_id: int) -> int:
    """A master port every task of a job derives alike: ``20000 + job_id % 20000``.

    Two jobs sharing a first node collide only when their ids differ by a multiple of 20000.
    """
    return DEFAULT_PORT_BASE + job_id % DEFAULT_PORT_SPAN
