"""hpZ (ZeRO++ hierarchical partitioning): ZeRO-3 with a secondary copy of each parameter
shard inside groups of H consecutive data ranks (``zero_hpz_partition_size`` = H, one host).

The primary partition is flat ZeRO-3's (zero/gathering.py): each unit of P elements (padded to
a multiple of N) is cut into N shards of P/N, and the optimizer steps them. hpZ adds, per rank,
the secondary shard of the same flat buffer cut into H parts; rank j of a group of H keeps

    secondary_j = flat[j P/H : (j+1) P/H]            (P/H elements, the compute dtype)

filled from the first all-gather of a unit after its values changed (over all N ranks, as
flat ZeRO-3) and valid until they change again: every later gather of the unit, the backward
ones and the forwards of later micro-batches, runs over the H ranks of the group alone. As in
DeepSpeed (``invalidate_secondary_tensor``), the values change at the optimizer step and at a
checkpoint save or load; a ``GatheredParameters`` change re-cuts the secondary from the
broadcast values (``refill``). Gradients reduce-scatter over all N ranks, the norm and the
optimizer state are flat ZeRO-3's: hpZ moves no arithmetic, it only moves values.

Per step at GAS = 1, per sharded unit (ring model, comm.py), with a group = a host:

    flat ZeRO-3:  all-gather (N-1)/N P twice + reduce-scatter (N-1)/N P, all crossing hosts
    hpZ:          forward all-gather (N-1)/N P + reduce-scatter (N-1)/N P across hosts,
                  backward all-gather (H-1)/H P inside the host

so a third of the traffic across hosts goes away (more with accumulation: one crossing gather
per step instead of 2 GAS), for P/H more parameter memory per rank (DeepSpeed keeps the
secondary the same way). Persistent units are whole on every rank and unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise import comm
from shardwise.config.errors import ConfigError
from shardwise.parallel.zero.stage3 import Zero3Strategy

if TYPE_CHECKING:  # annotations only
    from torch.optim import Optimizer

    from shardwise.checkpoint.rank_pieces import Layout
    from shardwise.parallel.strategy_contract import StrategyContext
    from shardwise.parallel.zero.gathering import Unit
    from shardwise.topology import ProcessMesh, Topology

KEY = "zero_optimization.zero_hpz_partition_size"


def hpz_groups(topo: Topology, size: int) -> list[list[int]]:
    """Every secondary group: ``size`` consecutive ranks of each data x context group, in
    ``dp_cp_index`` order (DeepSpeed cuts the world into consecutive ranks; with one tensor
    and pipeline rank the two agree). Refuses a size that does not divide the data ranks."""
    if topo.zero_shard:
        raise ConfigError(
            f"{KEY}={size} with mics_shard_size={topo.zero_shard}: MiCS already keeps every "
            "gather inside its shard group; use one of the two (remove a key)",
            key=KEY,
        )
    if topo.dp_cp % size:
        raise ConfigError(
            f"{KEY}={size} does not divide the {topo.dp_cp} data-parallel ranks: use a divisor "
            f"of {topo.dp_cp} (the data ranks of one host), or 1 to turn hpZ off",
            key=KEY,
        )
    return [g[i : i + size] for g in topo.dp_cp_groups() for i in range(0, len(g), size)]


class HpzGroup:
    """This rank's secondary group, and the generation its secondary shards are valid for."""

    def __init__(self, mesh: ProcessMesh, size: int) -> None:
        self.size, self.generation = size, 0
        for ranks in hpz_groups(mesh.topology, size):  # every rank makes every group, in order
            group = mesh.group_of(ranks, "zero-hpz")
            if mesh.rank in ranks:
                self.group, self.rank = group, ranks.index(mesh.rank)

    def invalidate(self) -> None:
        """The primary shards changed: the next gather of each unit crosses all N ranks."""
        self.generation += 1


class Secondary:
    """One unit's secondary shard; called as its gather (``Unit.gather``: (full, shard) ->
    handle): over the H group from the secondary while it is valid, else over the unit's
    group from the primary shard (through the hook it had, if any), filling the secondary when
    that gather completes."""

    def __init__(self, unit: Unit, part: HpzGroup) -> None:
        self.unit, self.part, self.filled = unit, part, -1  # filled: the generation, -1 never
        self.primary = unit.gather  # the unit's own gather hook (None: one all-gather)
        n = unit.layout.padded // part.size
        self.tensor = torch.zeros(n, dtype=unit.shard.dtype, device=unit.shard.device)

    @property
    def valid(self) -> bool:
        return self.filled == self.part.generation

    def __call__(self, full: torch.Tensor, shard: torch.Tensor) -> Any:
        if self.valid:
            mine = self.tensor.to(full.device, non_blocking=True)
            return comm.all_gather_into_tensor(full, mine, group=self.part.group, async_op=True)
        if self.primary is not None:
            return _Fill(self.primary(full, shard), full, self)
        work = comm.all_gather_into_tensor(full, shard, group=self.unit.group, async_op=True)
        return _Fill(work, full, self)

    def refill(self, full: torch.Tensor) -> None:
        """Cut this rank's secondary shard out of the whole flat buffer ``full``."""
        n = self.tensor.numel()
        with torch.no_grad():
            self.tensor.copy_(full[self.part.rank * n : (self.part.rank + 1) * n])
        self.filled = self.part.generation


class _Fill:
    """The handle of a gather over all N ranks: waiting fills the secondary from its result."""

    def __init__(self, work: Any, full: torch.Tensor, secondary: Secondary) -> None:
        self.work, self.full, self.secondary = work, full, secondary

    def wait(self) -> None:
        self.work.wait()
        self.secondary.refill(self.full)


class HpzStrategy(Zero3Strategy):
    """ZeRO stage 3 with hpZ's secondary shards (module docstring): flat ZeRO-3, whose units
    gather through their ``Secondary``, which the step and checkpoints invalidate."""

    @classmethod
    def accepts(cls, ctx: StrategyContext) -> bool:
        zero = ctx.config.zero_optimization
        return zero.stage == 3 and zero.zero_hpz_partition_size > 1

    @classmethod
    def from_context(cls, ctx: StrategyContext) -> HpzStrategy:
        part = HpzGroup(ctx.mesh, ctx.config.zero_optimization.zero_hpz_partition_size)
        made = super().from_context(ctx)
        made.hpz = part
        made.secondaries = [Secondary(u, part) for u in made.units if not u.persistent]
        for s in made.secondaries:
            s.unit.gather = s
        return made

    def step(self, optimizer: Optimizer, coef: float) -> None:
        super().step(optimizer, coef)
        self.hpz.invalidate()

    def checkpoint_layout(
        self, module: nn.Module, optimizer: Optimizer, mesh: ProcessMesh
    ) -> Layout:
        """Flat ZeRO-3's; a load may write the primary shards through it (as DeepSpeed's
        checkpoint events, a save invalidates too: every rank takes part in both)."""
        self.hpz.invalidate()
        return super().checkpoint_layout(module, optimizer, mesh)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Flat ZeRO-3's, and the secondary shards under ``hpz_secondary``."""
        return {**super().memory_tensors(), "hpz_secondary": [s.tensor for s in self.secondaries]}
