"""DeepSpeed's ``ProcessTopology`` and its two pipeline forms.

A topology names axes and their sizes; ranks are numbered row-major, the last axis varying
fastest: for axes ``[a0, ..., an]`` with sizes ``[d0, ..., dn]``,
``rank = sum_k c_k * prod_{j > k} d_j``. ``PipeDataParallelTopology(num_pp, num_dp)`` is
``['pipe', 'data']``; ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` is
``['pipe', 'data', 'model']`` with sizes ``[num_pp, num_dp, num_mp]`` (tensor-parallel neighbours
are consecutive ranks). This is the order of shardwise's own mesh (``shardwise.topology``:
pipeline outermost, then data, then tensor), so a script that passes one to
``PipelineModule(topology=...)`` gets the same stages; ``initialize`` refuses a topology whose
sizes disagree with the layout the config and the world give (``check_layout``).
"""

from __future__ import annotations

import itertools
import math
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

from shardwise.config import ConfigError

# DeepSpeed's axis names -> shardwise's mesh axes (shardwise.topology.AXES)
MESH_AXES = {"pipe": "pp", "data": "dp", "model": "tp"}


class ProcessTopology:
    """Axes ``axes`` of sizes ``dims``, ranks numbered row-major (the module docstring)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(
                f"ProcessTopology(axes={axes}, dims={dims}): one size per distinct axis"
            )
        if any(not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"ProcessTopology(dims={dims}): every size must be an integer >= 1")
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # DeepSpeed's attribute name
        self._strides = [math.prod(self.dims[k + 1 :]) for k in range(len(self.dims))]

    def world_size(self) -> int:
        return math.prod(self.dims)

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 for an axis this topology does not have, as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord: int) -> int:
        """The rank at ``coord``, which must name every axis (``filter_match`` for a slice)."""
        if set(coord) != set(self.axes):
            raise ValueError(
                f"get_rank({coord}) needs a coordinate for each of {self.axes}; "
                "use filter_match() for the ranks of a slice"
            )
        for axis, c in coord.items():
            if not 0 <= c < self.get_dim(axis):
                raise ValueError(f"get_rank: {axis}={c} is outside 0..{self.get_dim(axis) - 1}")
        return sum(coord[a] * s for a, s in zip(self.axes, self._strides, strict=True))

    def get_coord(self, rank: int) -> Any:
        """The coordinate of ``rank``, a namedtuple with one field per axis."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} not found in topology (world size {self.world_size()})")
        return self.ProcessCoord(
            *((rank // s) % d for s, d in zip(self._strides, self.dims, strict=True))
        )

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Sequence[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """``model_01``-style names of ``rank``'s coordinate, the omitted axes left out (the
        suffix of DeepSpeed's per-rank checkpoint files)."""
        coord = self.get_coord(rank)
        kept = [a for a in self.axes if a not in set(omit_axes)]
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in kept)

    def filter_match(self, **where: int) -> list[int]:
        """The ranks whose coordinate equals ``where`` on the axes it names, in rank order."""
        unknown = set(where) - set(self.axes)
        if unknown:
            raise ValueError(f"filter_match: no axis {sorted(unknown)} in {self.axes}")
        return [
            r
            for r in range(self.world_size())
            if all(getattr(self.get_coord(r), a) == v for a, v in where.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks at index ``idx`` of ``axis``."""
        return self.filter_match(**{axis: idx})

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along ``axis`` (its communicators); [] if absent."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            at = dict(zip(others, fixed, strict=True))
            lists.append([self.get_rank(**at, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def mesh_sizes(self) -> dict[str, int]:
        """Sizes by shardwise mesh axis (``pp``, ``dp``, ``tp``); ValueError for another axis."""
        unknown = [a for a in self.axes if a not in MESH_AXES]
        if unknown:
            raise ValueError(
                f"topology axes {unknown}: shardwise lays ranks out on {list(MESH_AXES)} "
                "(pipeline, data, tensor); give the others through the config"
            )
        return {MESH_AXES[a]: d for a, d in zip(self.axes, self.dims, strict=True)}

    def __str__(self) -> str:
        return str({self.get_coord(r): r for r in range(self.world_size())})


class PipeDataParallelTopology(ProcessTopology):
    """Axes ``['pipe', 'data']``: pipeline stages outermost, data replicas inside."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Axes ``['pipe', 'data', 'model']`` with sizes ``[num_pp, num_dp, num_mp]``."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def check_layout(topology: Any, layout: dict[str, int]) -> None:
    """Refuse a module's topology whose sizes differ from the mesh's (``layout``: pp, dp, tp,
    cp), naming the axis and the config key that sets it."""
    if not isinstance(topology, ProcessTopology):
        return
    # the data size is what the world leaves: the launch's process count sets it
    keys = {"pp": "pipeline.stages", "dp": "the number of processes", "tp": "tensor_parallel.size"}
    sizes = topology.mesh_sizes()
    for axis, size in sizes.items():
        if layout.get(axis, 1) != size:
            name = next(a for a, m in MESH_AXES.items() if m == axis)
            raise ConfigError(
                f"PipelineModule(topology=...) has {name}={size} but this run lays out "
                f"{axis}={layout.get(axis, 1)}: make {keys[axis]} (or the world size) and the "
                "topology agree",
                key="" if axis == "dp" else keys[axis],
            )
    if math.prod(sizes.values()) != math.prod(layout.values()):
        raise ConfigError(
            f"PipelineModule(topology=...) covers {topology.world_size()} ranks but this run's "
            f"layout {layout} has {math.prod(layout.values())}: add the missing axes to the "
            "topology or drop them from the config",
            key="tensor_parallel.size" if layout.get("tp", 1) > 1 else "context_parallel.size",
        )
