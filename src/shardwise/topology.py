"""The process mesh: data x pipeline x tensor, built once and passed explicitly.

Rank order (row-major, last axis fastest), the same as DeepSpeed's
``PipeModelDataParallelTopology`` and Megatron's default::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

Tensor-parallel peers are neighbouring ranks (they talk most, so they sit on one node),
then data-parallel peers, then pipeline stages (they exchange the least).

``Topology`` is pure arithmetic and needs no processes; ``ProcessMesh`` holds the live
``torch.distributed`` groups of one rank. Every group is created exactly once, by every rank,
in the same order, as ``torch.distributed.new_group`` requires.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

AXES = ("pp", "dp", "tp")  # outermost to innermost
AXIS_NAMES = {"pp": "pipeline", "dp": "data", "tp": "tensor"}  # also the groups' names


class TopologyError(ValueError):
    """A layout that cannot be built on this many processes."""


@dataclass(frozen=True)
class Coord:
    """Where one rank sits in the mesh."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    """Sizes of the three parallel axes; ``dp * pp * tp`` is the world size."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise TopologyError(
                    f"{AXIS_NAMES[axis]}-parallel size {axis}={size!r} must be an integer >= 1"
                )

    @classmethod
    def build(cls, world_size: int, dp: int | None = None, pp: int = 1, tp: int = 1) -> Topology:
        """Build the mesh for ``world_size`` processes; ``dp=None`` takes what pp and tp leave.

        The error prints every factor so a wrong launch is obvious at a glance.
        """
        if world_size < 1:
            raise TopologyError(f"world size {world_size} must be >= 1")
        if dp is None:
            if pp < 1 or tp < 1 or world_size % (pp * tp) != 0:
                raise TopologyError(
                    f"world size {world_size} is not divisible by pipeline {pp} x tensor {tp} "
                    f"= {pp * tp}: launch a multiple of {pp * tp} processes or change "
                    "pipeline.stages / tensor_parallel.size"
                )
            dp = world_size // (pp * tp)
        topo = cls(dp=dp, pp=pp, tp=tp)
        if topo.world_size != world_size:
            raise TopologyError(
                f"data {dp} x pipeline {pp} x tensor {tp} = {topo.world_size} processes, "
                f"but the world size is {world_size}: the product must equal the number of "
                "processes launched"
            )
        return topo

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def size(self, axis: str) -> int:
        """Size of a named axis: 'dp', 'pp' or 'tp'."""
        if axis not in AXES:
            raise KeyError(f"unknown axis {axis!r}; axes are {AXES}")
        return getattr(self, axis)

    def coord(self, rank: int) -> Coord:
        """The (pp, dp, tp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world of size {self.world_size}")
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return Coord(pp=pp, dp=dp, tp=tp)

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The global rank at given coordinates."""
        for axis, value in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= value < self.size(axis):
                raise IndexError(f"{axis}={value} outside 0..{self.size(axis) - 1}")
        return pp * self.dp * self.tp + dp * self.tp + tp

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
            [self.rank(pp=p, dp=d, tp=t) for p in range(self.pp) for t in range(self.tp)]
            for d in range(self.dp)
        ]

    def expert_groups(self, ep: int) -> tuple[list[list[int]], list[list[int]]]:
        """Expert parallelism of size ``ep`` inside the data axis (DeepSpeed's layout): the
        expert-parallel groups, ``ep`` consecutive data ranks that split the experts between
        them, and the expert-data groups, the data ranks holding the same experts (strided by
        ``ep``), whose expert gradients are reduced together. Every (pp, tp) coordinate's groups."""
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or self.dp % ep:
            raise TopologyError(
                f"expert-parallel size ep_size={ep!r} must divide the data-parallel size "
                f"dp={self.dp}: pick an ep_size among the divisors of {self.dp}"
            )
        ep_groups, edp_groups = [], []
        for data in self.axis_groups("dp"):
            ep_groups += [data[i : i + ep] for i in range(0, self.dp, ep)]
            edp_groups += [data[i::ep] for i in range(ep)]
        return ep_groups, edp_groups

    def peers(self, rank: int, axis: str) -> list[int]:
        """The ranks in ``rank``'s group along ``axis`` (itself included)."""
        c = self.coord(rank)
        base = {"pp": c.pp, "dp": c.dp, "tp": c.tp}
        return [self.rank(**{**base, axis: i}) for i in range(self.size(axis))]

    def rank_table(self, hosts: Sequence[str] | None = None, nproc_per_node: int = 0) -> str:
        """A printable table: rank, host, local rank and mesh coordinates of every process.

        ``hosts`` names the node of each rank (``hosts[rank]``); with ``nproc_per_node`` and no
        hosts, nodes are numbered ``node0``, ``node1``... as a launcher would fill them.
        """
        per_node = nproc_per_node or self.world_size
        rows = [("rank", "host", "local_rank", "pp", "dp", "tp")]
        for r in range(self.world_size):
            c = self.coord(r)
            host = hosts[r] if hosts else f"node{r // per_node}"
            rows.append((str(r), host, str(r % per_node), str(c.pp), str(c.dp), str(c.tp)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
        header = f"Topology: data {self.dp} x pipeline {self.pp} x tensor {self.tp} = {self.world_size} processes"
        return "\n".join([header, *lines])


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
    _made: dict[tuple[int, ...], Any] = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, topology: Topology, rank: int | None = None) -> ProcessMesh:
        """Create every axis group (all ranks must call this together, in the same order)."""
        initialized = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        if initialized and dist.get_world_size() != topology.world_size:
            raise TopologyError(
                f"topology data {topology.dp} x pipeline {topology.pp} x tensor {topology.tp} "
                f"= {topology.world_size} processes, but torch.distributed has "
                f"{dist.get_world_size()}"
            )
        mesh = cls(topology=topology, rank=rank)
        if not initialized:
            return mesh
        for axis in AXES:
            for members in topology.axis_groups(axis):
                whole = len(members) == topology.world_size
                group = None if whole else new_group(members, AXIS_NAMES[axis])
                if rank in members:
                    mesh.groups[axis] = group if group is not None else dist.group.WORLD
        for members in topology.model_parallel_groups():
            whole = len(members) == topology.world_size
            group = None if whole else new_group(members, "model-parallel")
            if rank in members:
                mesh.groups["model_parallel"] = group if group is not None else dist.group.WORLD
        return mesh

    @property
    def coord(self) -> Coord:
        return self.topology.coord(self.rank)

    def group_of(self, ranks: Sequence[int], name: str) -> Any:
        """The process group of ``ranks`` (named ``name`` in errors), made on first use and
        kept: every rank must ask for the same tuples in the same order, members or not. None
        for one rank, or when torch.distributed is not initialized."""
        key = tuple(ranks)
        if len(key) < 2 or not (dist.is_available() and dist.is_initialized()):
            return None
        if key not in self._made:
            self._made[key] = new_group(key, name)
        return self._made[key]

    def stage_group(self) -> tuple[Any, int]:
        """The group of the ranks that run this rank's pipeline stage (data x tensor) and its
        first rank. Every stage's group is made, in stage order (every rank takes part)."""
        topo, mine = self.topology, None
        for s in range(topo.pp):
            ranks = [topo.rank(pp=s, dp=d, tp=t) for d in range(topo.dp) for t in range(topo.tp)]
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

    def expert_groups(self, ep: int) -> tuple[tuple[Any, list[int]], tuple[Any, list[int]]]:
        """``((ep_group, ep_ranks), (expert_data_group, expert_data_ranks))`` of this rank for
        expert parallelism of size ``ep`` (``Topology.expert_groups``); every rank makes all."""
        ep_groups, edp_groups = self.topology.expert_groups(ep)
        out = {}
        for kind, groups in (("expert-parallel", ep_groups), ("expert-data", edp_groups)):
            for ranks in groups:
                group = self.group_of(ranks, f"{kind}:ep_size_{ep}")
                if self.rank in ranks:
                    out[kind] = (group, ranks)
        return out["expert-parallel"], out["expert-data"]

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


def world_timeout() -> datetime.timedelta | None:
    """The collective timeout the world group was created with (``init_distributed(timeout=)``,
    ``$SHARDWISE_TIMEOUT_S``), or None when torch does not say."""
    try:
        default = dist.distributed_c10d._get_default_group()
        backend = default._get_backend(
            torch.device("cpu" if dist.get_backend() == "gloo" else "cuda")
        )
        return backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def new_group(ranks: Sequence[int], name: str) -> Any:
    """``dist.new_group`` with the world's timeout and a name for errors and traces: without a
    timeout a sub-group keeps torch's 30-minute default, whatever the world was given, so a
    hang on a data or tensor group would wait that long. Every rank must call it, same order."""
    return dist.new_group(list(ranks), timeout=world_timeout(), group_desc=name)


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
