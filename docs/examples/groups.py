"""Ranks, the default process group and sub-groups, on 4 processes.

    python docs/examples/groups.py                  # 4 processes started by shardwise.spawn
    shardwise run --nproc-per-node 4 docs/examples/groups.py

Each rank builds a data 2 x tensor 2 mesh (``Topology`` + ``ProcessMesh``) and a group of the
even ranks (``new_subgroup``), then all-reduces its own rank number in each group it belongs
to. The table shows, for every process, its global rank, its place on the node, its rank
inside each group and what each all-reduce returned: the sum of the ranks of that group.
Explained in docs/concepts.md.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import shardwise
from shardwise import comm
from shardwise.topology import ProcessMesh, Topology, new_subgroup

NPROCS = 4


def _sum_of_ranks(group: object) -> int:
    """All-reduce (sum) this rank's global rank over ``group``."""
    t = torch.tensor([float(comm.get_rank())])
    comm.all_reduce(t, group=group)
    return int(t.item())


def describe(rank: int = 0) -> dict:
    """Run on every rank: where it sits, and one all-reduce per group it belongs to."""
    env = shardwise.init_distributed(verbose=False)  # already initialized: returns its env
    world = dist.get_world_size()
    mesh = ProcessMesh.create(Topology.build(world, tp=2))  # dp = world / tp
    # Every rank creates every group, members or not, in the same order (torch requires it).
    evens = new_subgroup(range(0, world, 2))
    member = env.rank % 2 == 0
    return {
        "rank": env.rank,
        "node": env.node_rank,
        "local_rank": env.local_rank,
        "world": world,
        "dp_rank": mesh.dp_rank,
        "tp_rank": mesh.tp_rank,
        "sum_world": _sum_of_ranks(None),  # None: the default group, every process
        "sum_dp": _sum_of_ranks(mesh.dp_group),
        "sum_tp": _sum_of_ranks(mesh.tp_group),
        "even_rank": dist.get_rank(evens) if member else "-",
        "sum_even": _sum_of_ranks(evens) if member else "-",  # only members may call
    }


def report(rows: list[dict]) -> str:
    keys = list(rows[0])
    table = [keys] + [[str(row[k]) for k in keys] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(keys))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in table]
    world = rows[0]["world"]
    topo = Topology.build(world, tp=2)
    groups = (
        f"data groups {topo.axis_groups('dp')}, tensor groups {topo.axis_groups('tp')}, "
        f"even group {list(range(0, world, 2))}"
    )
    return "\n".join([groups, *lines])


def main() -> None:
    if "RANK" in os.environ:  # started by a launcher: this process is one rank
        shardwise.init_distributed(verbose=False)
        row = describe()
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if row["rank"] == 0:
            print(report(rows), flush=True)
    else:
        print(report(shardwise.spawn(describe, nprocs=NPROCS, timeout=120)), flush=True)


if __name__ == "__main__":
    main()
