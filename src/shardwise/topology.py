"""The process mesh: data x context x pipeline x tensor, built once and passed explicitly.

Rank order (row-major, last axis fastest), the same as DeepSpeed's
``PipeModelDataParallelTopology`` and Megatron's default (tp-cp-dp-pp, tp fastest)::

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

Tensor-parallel peers are neighbouring ranks (they talk most, so they sit on one node),
then context-parallel peers (they pass K/V blocks every layer), then data-parallel peers, then
pipeline stages (they exchange the least).

Context-parallel ranks hold the same parameters and see other tokens of the same samples, so
for parameters they are data-parallel ranks: gradients are reduced, and ZeRO shards, over the
data x context ranks (``dp_cp``: the ranks that share the pipeline and tensor coordinates).

MiCS / HSDP (``mics_shard_size`` = S) cuts each data x context group, in ``dp_cp_index`` order,
into R = dp_cp / S replicas of S consecutive ranks: ZeRO shards over a replica's S ranks
(``zero_shard``), each shard is all-reduced over the R ranks holding it (``zero_replicate``).

``Topology`` is pure arithmetic and needs no processes; ``ProcessMesh`` holds the live
``torch.distributed`` groups of one rank. Every group is created exactly once, by every rank,
in the same order, as ``torch.distributed.new_group`` requires.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from shardwise.launch.rank_table import rank_table
from shardwise.launch.timeout import world_timeout


class TopologyError(ValueError):
    """A layout that cannot be built on this many processes."""


AXES = ("pp", "dp", "cp", "tp")  # outermost to innermost
AXIS_NAMES = {"pp": "pipeline", "dp": "data", "cp": "context", "tp": "tensor"}  # groups' names


@dataclass(frozen=True)
class Coord:
    """Where one rank sits in the mesh."""

    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Topology:
    """Sizes of the parallel axes; ``dp * cp * pp * tp`` is the world size."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    zero_shard: int = 0  # MiCS: ranks per ZeRO shard group; 0: every data x context rank

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise TopologyError(
                    f"{AXIS_NAMES[axis]}-parallel size {axis}={size!r} must be an integer >= 1"
                )
        if self.zero_shard and self.dp_cp % self.zero_shard:
            raise TopologyError(
                f"zero_optimization.mics_shard_size={self.zero_shard} does not divide the {self.dp_cp}"
                f" data-parallel ranks: use a divisor of {self.dp_cp} (the ranks of one host), or -1"
            )

    @classmethod
    def build(
        cls,
        world_size: int,
        dp: int | None = None,
        pp: int = 1,
        tp: int = 1,
        cp: int = 1,
        zero_shard: int = 0,
    ) -> Topology:
        """Build the mesh for ``world_size`` processes; ``dp=None`` takes what the others leave.

        The error prints every factor so a wrong launch is obvious at a glance.
        """
        if world_size < 1:
            raise TopologyError(f"world size {world_size} must be >= 1")
        if dp is None:
            if pp < 1 or tp < 1 or cp < 1 or world_size % (pp * tp * cp) != 0:
                ctx = f" x context {cp}" if cp != 1 else ""
                raise TopologyError(
                    f"world size {world_size} is not divisible by pipeline {pp} x tensor {tp}"
                    f"{ctx} = {pp * tp * cp}: launch a multiple of {pp * tp * cp} processes or "
                    "change pipeline.stages / tensor_parallel.size / context_parallel.size"
                )
            dp = world_size // (pp * tp * cp)
        topo = cls(dp=dp, pp=pp, tp=tp, cp=cp, zero_shard=zero_shard)
        if topo.world_size != world_size:
            raise TopologyError(
                f"{topo.describe()} processes, but the world size is {world_size}: the "
                "product must equal the number of processes launched"
            )
        return topo

    def describe(self) -> str:
        """``data 2 x pipeline 1 x tensor 2 = 4`` (context when split; MiCS replicas x shard)."""
        ctx = f" x context {self.cp}" if self.cp > 1 else ""
        if self.zero_shard:
            ctx += f" ({self.replicas} replicas x shard {self.zero_shard})"
        return f"data {self.dp}{ctx} x pipeline {self.pp} x tensor {self.tp} = {self.world_size}"

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def dp_cp(self) -> int:
        """How many ranks hold each parameter slice: data x context (gradients average there)."""
        return self.dp * self.cp

    @property
    def replicas(self) -> int:
        """R: how many copies of each ZeRO shard the data x context ranks hold (MiCS)."""
        return self.dp_cp // (self.zero_shard or self.dp_cp)

    def zero_groups(self, kind: str) -> list[list[int]]:
        """MiCS: every "shard" group (S consecutive data x context ranks: ZeRO shards over them)
        or "replicate" group (R ranks, one per shard group, holding the same shard)."""
        s, out = self.zero_shard or self.dp_cp, []
        for g in self.dp_cp_groups():
            rows = [g[i : i + s] for i in range(0, len(g), s)]
            out += rows if kind == "shard" else [list(c) for c in zip(*rows, strict=True)]
        return out

    def size(self, axis: str) -> int:
        """Size of a named axis: 'dp', 'cp', 'pp' or 'tp'."""
        if axis not in AXES:
            raise KeyError(f"unknown axis {axis!r}; axes are {AXES}")
        return getattr(self, axis)

    def coord(self, rank: int) -> Coord:
        """The (pp, dp, tp, cp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of size {self.world_size}")
        pp, rest = divmod(rank, self.dp * self.cp * self.tp)
        dp, rest = divmod(rest, self.cp * self.tp)
        cp, tp = divmod(rest, self.tp)
        return Coord(pp=pp, dp=dp, tp=tp, cp=cp)

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The global rank at given coordinates."""
        for axis, value in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not 0 <= value < self.size(axis):
                raise IndexError(f"{axis}={value} outside 0..{self.size(axis) - 1}")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def dp_cp_index(self, rank: int) -> int:
        """A rank's index among the data x context ranks of its (pp, tp) coordinate."""
        c = self.coord(rank)
        return c.dp * self.cp + c.cp

    def dp_cp_groups(self) -> list[list[int]]:
        """The ranks that hold the same parameter slice (same pp and tp coordinates), in
        ``dp_cp_index`` order: gradient reduction and ZeRO sharding run over them."""
        return [
            [self.rank(pp=p, dp=d, cp=c, tp=t) for d in range(self.dp) for c in range(self.cp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: ranks that differ only in that coordinate.

        Ordered by the other coordinates, so all ranks enumerate them identically.
        """
        others = [a for a in AXES if a != axis]
        groups = []
        for fixed in itertools.product(*(range(self.size(a)) for a in others)):
            base = dict(zip(others, fixed, strict=True))
            groups.append([self.rank(**{**base, axis: i}) for i in range(self.size(axis))])
        return groups

    def model_parallel_groups(self) -> list[list[int]]:
        """Ranks that share a data-parallel coordinate: together they hold one model replica
        (its pipeline stages and tensor-parallel slices). The gradient norm sums over them."""
        return [
            [self.rank(pp=p, dp=d, cp=c, tp=t) for p in range(self.pp) for t in range(self.tp)]
            for d in range(self.dp)
            for c in range(self.cp)
        ]

    def peers(self, rank: int, axis: str) -> list[int]:
        """The ranks in ``rank``'s group along ``axis`` (itself included)."""
        c = self.coord(rank)
        base = {"pp": c.pp, "dp": c.dp, "tp": c.tp, "cp": c.cp}
        return [self.rank(**{**base, axis: i}) for i in range(self.size(axis))]

    def rank_table(self, hosts: Sequence[str] | None = None, nproc_per_node: int = 0) -> str:
        """Rank, host, local rank and mesh coordinates of every process (launch/rank_table.py)."""
        return rank_table(self, hosts, nproc_per_node)


@dataclass
class ProcessMesh:
    """One rank's view of the mesh: its coordinates and the live process groups.

    Groups are ``None`` when the world has one process and torch.distributed is not
    initialized; ``shardwise.comm`` treats a ``None`` group of size 1 as a no-op.
    """

    topology: Topology
    rank: int
    groups: dict[str, Any] = field(default_factory=dict)
    # Groups beyond the axes (pipeline stages, tied weights), made once per rank tuple.
    _made: dict[tuple, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, topology: Topology, rank: int | None = None) -> ProcessMesh:
        """Create every axis group (all ranks must call this together, in the same order)."""
        initialized = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        if initialized and dist.get_world_size() != topology.world_size:
            raise TopologyError(
                f"topology {topology.describe()} processes, but torch.distributed has "
                f"{dist.get_world_size()}"
            )
        mesh = cls(topology=topology, rank=rank)
        if not initialized:
            return mesh
        for axis in AXES:
            if axis == "cp" and topology.cp == 1:
                continue  # no context groups to make: the layouts without one keep theirs
            mesh._join(axis, topology.axis_groups(axis), AXIS_NAMES[axis])
        mesh._join("model_parallel", topology.model_parallel_groups(), "model-parallel")
        mesh.groups["dp_cp"] = mesh.groups["dp"]
        if topology.cp > 1:
            mesh._join("dp_cp", topology.dp_cp_groups(), "data-context")
        mesh.groups["zero_shard"] = mesh.groups["dp_cp"]  # MiCS: replaced by the shard group
        for kind in ("shard", "replicate") if topology.zero_shard else ():
            mesh._join(f"zero_{kind}", topology.zero_groups(kind), f"zero-{kind}")
        return mesh

    def _join(self, key: str, groups: list[list[int]], name: str) -> None:
        """Make every group of ``groups`` (all ranks, same order); keep this rank's as ``key``."""
        for members in groups:
            whole = len(members) == self.topology.world_size
            group = dist.group.WORLD if whole else new_group(members, name)
            if self.rank in members:
                self.groups[key] = group

    @property
    def coord(self) -> Coord:
        return self.topology.coord(self.rank)

    def group_of(self, ranks: Sequence[int], name: str, backend: str | None = None) -> Any:
        """The process group of ``ranks`` (named ``name`` in errors; on ``backend``, else the
        world's), made on first use and kept: every rank must ask for the same tuples in the
        same order, members or not. None for one rank, or when not distributed."""
        key = (*ranks, backend) if backend else tuple(ranks)
        if len(tuple(ranks)) < 2 or not (dist.is_available() and dist.is_initialized()):
            return None
        if key not in self._made:
            self._made[key] = new_group(tuple(ranks), name, backend=backend)
        return self._made[key]

    def own_group(self) -> Any:
        """A process group of this rank alone (None when not distributed), for callers that
        need a real one-rank group where ``group_of`` gives None (DeepSpeed's accessors). Made
        on first use by this rank only (``use_local_synchronization``), so no other rank waits."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        key = ("own", self.rank)
        if key not in self._made:
            self._made[key] = new_group([self.rank], f"rank-{self.rank}", local=True)
        return self._made[key]

    def stage_group(self) -> tuple[Any, int]:
        """The group of the ranks that run this rank's pipeline stage (data x tensor) and its
        first rank. Every stage's group is made, in stage order (every rank takes part)."""
        topo, mine = self.topology, None
        for s in range(topo.pp):
            ranks = [r for r in range(topo.world_size) if topo.coord(r).pp == s]
            group = self.group_of(ranks, f"pipeline-stage-{s}")
            mine = group if s == self.pp_rank else mine
        return mine, topo.rank(pp=self.pp_rank)

    def tied_group(self, key: str, stages: Sequence[int]) -> tuple[Any, int] | None:
        """For weights tied across pipeline ``stages``: the group of the copies this rank's
        data/tensor coordinate holds, ``[rank(s, d, t) for s in stages]``, and its first rank;
        None if this rank holds no copy. Every (d, t) group is made, by every rank."""
        topo, mine = self.topology, None
        for d in range(topo.dp):
            for t in range(topo.tp):
                ranks = [topo.rank(pp=s, dp=d, tp=t) for s in stages]
                group = self.group_of(ranks, f"tied:{key}")
                mine = (group, ranks[0]) if self.rank in ranks else mine
        return mine

    def group(self, axis: str) -> Any:
        """The process group of this rank along ``axis`` (None when not distributed)."""
        return self.groups.get(axis)

    def axis_rank(self, axis: str) -> int:
        return getattr(self.coord, axis)

    def axis_size(self, axis: str) -> int:
        return self.topology.size(axis)

    def axis_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in axis order."""
        return self.topology.peers(self.rank, axis)

    @property
    def dp_group(self) -> Any:
        return self.group("dp")

    @property
    def cp_group(self) -> Any:
        """The context-parallel group (None when the context is not split or not distributed)."""
        return self.group("cp")

    @property
    def dp_cp_group(self) -> Any:
        """The ranks holding this rank's parameter slice (data x context): gradients are
        averaged and ZeRO shards over it. The data group itself when the context is whole."""
        return self.group("dp_cp")

    @property
    def dp_cp_rank(self) -> int:
        return self.topology.dp_cp_index(self.rank)

    def dp_cp_ranks(self) -> list[int]:
        """Global ranks of this rank's data x context group, in ``dp_cp_rank`` order."""
        return next(g for g in self.topology.dp_cp_groups() if self.rank in g)

    @property
    def pp_group(self) -> Any:
        return self.group("pp")

    @property
    def tp_group(self) -> Any:
        return self.group("tp")

    @property
    def model_parallel_group(self) -> Any:
        """The pipeline x tensor ranks of this rank's model replica (None: not distributed)."""
        return self.groups.get("model_parallel")

    @property
    def model_parallel_size(self) -> int:
        return self.topology.pp * self.topology.tp

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def cp_rank(self) -> int:
        return self.coord.cp


def new_group(
    ranks: Sequence[int], name: str, local: bool = False, backend: str | None = None
) -> Any:
    """``dist.new_group`` with the world's timeout and a name for errors and traces: without a
    timeout a sub-group keeps torch's 30-minute default, whatever the world was given, so a
    hang on a data or tensor group would wait that long. Every rank must call it, same order
    (with ``local``, only the members: torch's ``use_local_synchronization``)."""
    extra = {"use_local_synchronization": True} if local else {}
    extra |= {"backend": backend} if backend else {}  # gloo: host-side work off the training
    return dist.new_group(list(ranks), timeout=world_timeout(), group_desc=name, **extra)


def new_subgroup(ranks: Sequence[int]) -> Any:
    """A process group of arbitrary ranks (for example the even ones).

    Every rank of the world must call this with the same list, members or not.
    """
    ranks = sorted(set(int(r) for r in ranks))
    world = dist.get_world_size()
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise TopologyError(f"ranks {bad} are outside the world of size {world}")
    return new_group(ranks, f"subgroup:{','.join(map(str, ranks))}")
