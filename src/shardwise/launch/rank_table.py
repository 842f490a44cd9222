"""The rank table that ``shardwise topo`` and the start of training print: for every process its
rank, host, local rank and mesh coordinates (``Topology.rank_table`` returns it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Sizes(Protocol):
    """What the table reads of a ``topology.Topology`` (named here: topology.py imports this)."""

    cp: int
    zero_shard: int

    @property
    def world_size(self) -> int: ...

    def coord(self, rank: int) -> Any: ...

    def dp_cp_index(self, rank: int) -> int: ...

    def describe(self) -> str: ...


def rank_table(topo: Sizes, hosts: Sequence[str] | None = None, nproc_per_node: int = 0) -> str:
    """A printable table: rank, host, local rank and mesh coordinates of every process.

    ``hosts`` names the node of each rank (``hosts[rank]``); with ``nproc_per_node`` and no
    hosts, nodes are numbered ``node0``, ``node1``... as a launcher would fill them. Under MiCS
    two more columns say which replica a rank belongs to and which shard it holds.
    """
    per_node = nproc_per_node or topo.world_size
    axes = [a for a in ("pp", "dp", "cp", "tp") if a != "cp" or topo.cp > 1]
    mics = ("replica", "shard") if topo.zero_shard else ()
    rows = [("rank", "host", "local_rank", *axes, *mics)]
    for r in range(topo.world_size):
        c, at = topo.coord(r), divmod(topo.dp_cp_index(r), topo.zero_shard or 1)
        host = hosts[r] if hosts else f"node{r // per_node}"
        where = [str(getattr(c, a)) for a in axes] + [str(i) for i in at[: len(mics)]]
        rows.append((str(r), host, str(r % per_node), *where))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    header = f"Topology: {topo.describe()} processes"
    return "\n".join([header, *lines])
