"""The debug check (``"comms": {"fingerprint": true}``): before each collective, the ranks of
its group compare what they are about to run, and a mismatch raises on every one of them.

Each rank all-gathers, over the collective's own group, a fixed-size int64 row (``WIDTH``):

    op code, sequence number, number of tensors, then per tensor (up to 2): dtype code, ndim,
    numel, the first 6 dimensions

The rows must agree except the sequence number (shown, not compared; every rank numbers its
calls on a group the same way unless some calls bypass shardwise.comm). ``all_to_all`` with
explicit split sizes compares dtypes only (uneven splits are legal). When they disagree, the
ranks all-gather their call sites too (only then: one more collective, text), and every rank
raises ``CollectiveMismatchError`` naming each distinct call and the ranks making it. Without
the check, gloo turns a dtype mismatch of equal byte size into silent garbage and other size
mismatches into a hang or a C++ abort of one rank. Cost: one small all-gather per collective,
a latency-bound round trip (docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise.diagnose.calls import Call
from shardwise.wire_dtypes import WIRE_DTYPES

OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "barrier",
)
DTYPES = WIRE_DTYPES
DIMS = 6
PER_TENSOR = 3 + DIMS
WIDTH = 3 + 2 * PER_TENSOR
_SEQ = 1  # the column shown but not compared


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group are about to run different collectives (names each side)."""


def encode(
    op: str,
    seq: int,
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    symmetric: bool = True,
) -> list[int]:
    """The row one rank contributes (the module docstring gives the layout)."""
    row = [OPS.index(op) + 1 if op in OPS else 0, seq, len(dtypes)]
    for i in range(2):
        if i >= len(dtypes):
            row += [0] * PER_TENSOR
            continue
        dtype = DTYPES.index(dtypes[i]) + 1 if dtypes[i] in DTYPES else 99
        if not symmetric:
            row += [dtype] + [0] * (PER_TENSOR - 1)
            continue
        shape = list(shapes[i])
        numel = 1
        for d in shape:
            numel *= d
        row += [dtype, len(shape), numel, *(shape[:DIMS] + [0] * (DIMS - len(shape[:DIMS])))]
    return row


def describe(row: list[int]) -> str:
    """A row in words: ``all_reduce #3 float32 (4, 2)``."""
    op = OPS[row[0] - 1] if 0 < row[0] <= len(OPS) else "?"
    parts = [f"{op} #{row[_SEQ]}"]
    for i in range(min(row[2], 2)):
        dtype, ndim, numel, *dims = row[3 + i * PER_TENSOR : 3 + (i + 1) * PER_TENSOR]
        name = str(DTYPES[dtype - 1]).removeprefix("torch.") if 0 < dtype <= len(DTYPES) else "?"
        if ndim > DIMS:
            shape = f"({', '.join(map(str, dims))}, ...; {numel} elements)"
        else:
            shape = "(" + ", ".join(map(str, dims[:ndim])) + ("," if ndim == 1 else "") + ")"
        parts.append(f"{name} {shape}" if ndim or numel else name)
    return " ".join(parts)


def mismatch_message(call: Call, rows: list[list[int]], sites: list[str]) -> str:
    """Each distinct row with the ranks that sent it and their call sites."""
    ranks = call.group.ranks
    sides: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        key = tuple(row[:_SEQ] + row[_SEQ + 1 :])
        sides.setdefault(key, []).append(i)
    lines = []
    for members in sides.values():
        who = ", ".join(str(ranks[i]) for i in members)
        where = "; ".join(sorted({sites[i] for i in members}))
        label = "rank" if len(members) == 1 else "ranks"
        lines.append(f"  {label} {who}: {describe(rows[members[0]])} from {where}")
    return (
        f"collective mismatch in call #{call.seq} on {call.group.describe()}: the ranks are "
        f"about to run different collectives:\n" + "\n".join(lines) + "\nEvery rank of a group "
        "must make the same collectives in the same order, with the same dtypes and shapes "
        '(checked because "comms": {"fingerprint": true})'
    )


def check(call: Call, pg: dist.ProcessGroup, symmetric: bool = True) -> None:
    """All-gather this call's row over ``pg``; raise on every rank if the rows disagree."""
    mine = torch.tensor(encode(call.op, call.seq, call.shapes, call.dtypes, symmetric))
    rows = [torch.empty_like(mine) for _ in call.group.ranks]
    dist.all_gather(rows, mine, group=pg)
    lists = [r.tolist() for r in rows]
    strip = [row[:_SEQ] + row[_SEQ + 1 :] for row in lists]
    if all(s == strip[0] for s in strip):
        return
    path, line, fn = call.site
    sites: list[Any] = [None] * len(lists)
    dist.all_gather_object(sites, f"{path}:{line} in {fn}", group=pg)
    raise CollectiveMismatchError(mismatch_message(call, lists, sites))
