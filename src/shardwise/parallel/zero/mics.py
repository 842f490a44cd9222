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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardwise import comm
from shardwise.comm import Group

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

    @property
    def replicas(self) -> int:
        """R: the copies of each shard."""
        return len(self.holders)

    @property
    def scale(self) -> int:
        """N = S x R: the ranks whose gradients are averaged."""
        return len(self.shard_ranks) * self.replicas

    @classmethod
    def from_mesh(cls, mesh: ProcessMesh) -> ZeroGroups:
        """This rank's groups on ``mesh`` (MiCS when its topology has a ``zero_shard``)."""
        topo, data = mesh.topology, mesh.dp_cp_group
        if not topo.zero_shard:
            return cls(data, mesh.dp_cp_ranks(), None, (mesh.dp_cp_rank,), data)
        shard, rep = (
            next(g for g in topo.zero_groups(kind) if mesh.rank in g)
            for kind in ("shard", "replicate")
        )
        holders = tuple(topo.dp_cp_index(r) for r in rep)
        return cls(mesh.group("zero_shard"), shard, mesh.group("zero_replicate"), holders, data)

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
