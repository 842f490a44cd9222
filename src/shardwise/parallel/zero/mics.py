"""MiCS / HSDP: ZeRO sharded within groups of S ranks, replicated across the R = N / S groups.

The N data x context ranks are cut into R shard groups of S consecutive ranks (topology.py,
``Topology.zero_groups``). ZeRO runs unchanged inside each shard group: its flat buffers are
split into S shards, parameters are all-gathered and gradients reduce-scattered over the S
ranks. Rank j of every shard group holds the same shard j; the R ranks holding shard j form a
replicate group, and on each accumulation boundary every shard is summed over them once:

    each rank:        g_i / N                      (divided before summing, as flat ZeRO does)
    reduce-scatter:   shard j of sum over the S ranks of this group
    all-reduce:       shard j of sum over all N ranks = the mean gradient, shard j

Volume per step for P elements (ring model, comm.py), against flat ZeRO's over N ranks:

    within a group:   all-gather (S-1)/S P, reduce-scatter (S-1)/S P (per micro-step at stage 2-3)
    across groups:    all-reduce 2 (R-1)/R P/S of the shard, once per step

so the slow link between hosts (one host = one shard group) carries 2 (R-1)/R P/S instead of
the 2 (N-1)/N P of flat ZeRO; the price is memory: states are divided by S, not N.

The gradient norm sums the owned shards over the shard group only: the R replicas hold the
same shards, and summing over all N ranks would count every element R times.

``mics_hierarchical_params_gather`` (stage 3): a shard group spanning n nodes of k of its ranks
each gathers a unit's parameters in two hops, as DeepSpeed's MiCS does: first across nodes
among the n ranks at the same place of each node (inter), then inside the node (intra):

    hop 1 (inter, n ranks):  rank j of each node gets shards j, k + j, ..., (n-1) k + j
    hop 2 (intra, k ranks):  every rank gets all S = n k shards, as [j][node]; transposed to
                             [node][j], the order of one all-gather over the shard group

Bytes across nodes per rank: (n-1)/n P/k, in n-1 messages (a ring over all S ranks crossing
nodes sends (S-1)/S P through each node's link in S-1 steps).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardwise import comm
from shardwise.comm import Group
from shardwise.config.errors import ConfigError

if TYPE_CHECKING:  # annotations only
    from shardwise.topology import ProcessMesh


@dataclass(frozen=True)
class ZeroGroups:
    """Where ZeRO shards and where it replicates (without MiCS: S = N, R = 1)."""

    shard: Group  # the S ranks ZeRO shards over
    shard_ranks: list[int]  # their global ranks, in shard order
    replicate: Group  # the R ranks holding this rank's shard (used only when R > 1)
    holders: tuple[int, ...]  # their data x context indices (who may save the shard)
    data: Group  # all N data x context ranks (RNG broadcast, unsharded gradients)
    inter: Group = None  # two-hop gather: this rank's peers at its place on each node
    intra: Group = None  # ... and its shard group's ranks on its node
    nodes: int = 1  # nodes a shard group spans under a two-hop gather; 1: one all-gather

    @property
    def replicas(self) -> int:
        """R: the copies of each shard."""
        return len(self.holders)

    @property
    def scale(self) -> int:
        """N = S x R: the ranks whose gradients are averaged."""
        return len(self.shard_ranks) * self.replicas

    @classmethod
    def from_mesh(cls, mesh: ProcessMesh, two_hop: bool = False) -> ZeroGroups:
        """This rank's groups on ``mesh`` (MiCS when its topology has a ``zero_shard``);
        ``two_hop``: the groups of the hierarchical gather (module docstring)."""
        topo, data = mesh.topology, mesh.dp_cp_group
        if not topo.zero_shard:
            return cls(data, mesh.dp_cp_ranks(), None, (mesh.dp_cp_rank,), data)
        shard, rep = (
            next(g for g in topo.zero_groups(kind) if mesh.rank in g)
            for kind in ("shard", "replicate")
        )
        holders = tuple(topo.dp_cp_index(r) for r in rep)
        made = cls(mesh.group("zero_shard"), shard, mesh.group("zero_replicate"), holders, data)
        if not two_hop:
            return made
        inter, intra, nodes = _hop_groups(mesh, procs_per_node())
        return cls(made.shard, shard, made.replicate, holders, data, inter, intra, nodes)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> Any:
        """Launch the gather of every shard of the group into ``out``: one all-gather, or the
        two hops of the module docstring. Returns a handle to ``wait()`` for."""
        if self.nodes == 1:
            return comm.all_gather_into_tensor(out, shard, group=self.shard, async_op=True)
        across = torch.empty(self.nodes * shard.numel(), dtype=shard.dtype, device=shard.device)
        work = comm.all_gather_into_tensor(across, shard, group=self.inter, async_op=True)
        return _SecondHop(work, across, out, self)

    @classmethod
    def flat(cls, group: Group, ranks: Sequence[int] | None = None) -> ZeroGroups:
        """Flat ZeRO over ``group`` (a strategy built without a mesh)."""
        ranks = list(ranks) if ranks is not None else list(range(comm.get_world_size(group)))
        return cls(group, ranks, None, (comm.get_rank(group),), group)

    def allreduce(self, shards: Sequence[torch.Tensor | None]) -> None:
        """The one all-reduce across the replicas of each shard (in place; R = 1: nothing)."""
        if self.replicas == 1:
            return
        works = [
            comm.all_reduce(t, group=self.replicate, async_op=True) for t in shards if t is not None
        ]
        for w in works:
            w.wait()


class _SecondHop:
    """The handle of a two-hop gather: waiting finishes hop 1, runs hop 2, orders the shards."""

    def __init__(self, work: Any, across: torch.Tensor, out: torch.Tensor, g: ZeroGroups) -> None:
        self.work, self.across, self.out, self.groups = work, across, out, g

    def wait(self) -> None:
        self.work.wait()
        g, n = self.groups, self.across.numel() // self.groups.nodes  # n: one shard
        k = len(g.shard_ranks) // g.nodes
        mixed = torch.empty_like(self.out)  # [j][node][n] after hop 2
        comm.all_gather_into_tensor(mixed, self.across, group=g.intra)
        self.out.view(g.nodes, k, n).copy_(mixed.view(k, g.nodes, n).transpose(0, 1))


def procs_per_node() -> int:
    """Processes per node: ``NDEV_PER_NODE`` (DeepSpeed's MiCS override), else the launcher's
    ``LOCAL_WORLD_SIZE``, else the world (one node)."""
    for var in ("NDEV_PER_NODE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            return int(os.environ[var])
    return comm.get_world_size()


def _hop_groups(mesh: ProcessMesh, per_node: int) -> tuple[Group, Group, int]:
    """Make every shard group's inter and intra groups (all ranks, same order); this rank's
    two and the nodes its shard group spans. Refuses a group within one node, or spread
    unevenly, naming the key."""
    mine: dict[str, Group] = {}
    nodes = 1
    for members in mesh.topology.zero_groups("shard"):
        on = sorted({r // per_node for r in members})
        rows = [[r for r in members if r // per_node == node] for node in on]
        if len(rows) < 2 or len({len(row) for row in rows}) > 1 or len(rows[0]) < 2:
            raise ConfigError(
                f"zero_optimization.mics_hierarchical_params_gather: the shard group {members} "
                f"lies on nodes of {per_node} processes as {[len(r) for r in rows]}; a two-hop "
                "gather needs at least 2 nodes with the same number (at least 2) of its ranks "
                "each: set mics_shard_size to a multiple of the data ranks of one node, or "
                "remove the key",
                key="zero_optimization.mics_hierarchical_params_gather",
            )
        columns = [list(c) for c in zip(*rows, strict=True)]
        for kind, groups in (("inter", columns), ("intra", rows)):
            for ranks in groups:
                group = mesh.group_of(ranks, f"zero-{kind}-node")
                if mesh.rank in ranks:
                    mine[kind], nodes = group, len(rows)
    return mine["inter"], mine["intra"], nodes
