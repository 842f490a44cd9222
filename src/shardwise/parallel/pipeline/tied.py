"""Tied weights across stages: one logical parameter, a copy on every stage that uses it.

In one process a tied parameter (an input embedding reused as the output projection) gets the
sum of the gradients of its uses. Split over stages, each stage holding the key has a copy and
the gradient of its own uses; summing the copies' gradients over the stages that hold the key,
before the update, gives every copy the one-process gradient, so the copies stay identical
(same start, same gradient, same elementwise optimizer).

Groups: for a key held by stages S = [s_0, s_1, ...], one group per (data, tensor) coordinate,
``[rank(s, d, t) for s in S]``; the same data/tensor coordinate means the same slice of the
same data, so the sum is over copies of the same thing. Every rank creates every group, in
sorted key order (torch.distributed.new_group requires all ranks, same order); the mesh makes
them (``ProcessMesh.tied_group``), as it makes every group.

The sum runs after the data-parallel reduction, on the pieces of the gradient the strategy
owns (``strategy.reduced_grads(p)``: the whole averaged gradient for plain data parallelism,
this rank's reduced shard under ZeRO, where each tied parameter sits alone in its bucket so
that shard r covers the same elements on every stage). Summing is linear, so summing reduced
pieces equals reducing summed gradients.

Norm: each tied parameter counts once in the global gradient norm, on its first stage s_0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise import comm

if TYPE_CHECKING:  # annotations only
    from shardwise.parallel.strategy_contract import GradientStrategy
    from shardwise.topology import ProcessMesh


class TiedWeights:
    """This rank's tied parameters and their groups (see the module docstring)."""

    def __init__(self, module: nn.Module, mesh: ProcessMesh) -> None:
        self.module = module
        self.groups: dict[str, tuple[Any, int]] = {}  # key -> (group, rank of its first stage)
        for key in sorted(module.tied_stages):
            stages = module.tied_stages[key]
            mine = mesh.tied_group(key, stages) if len(stages) > 1 else None
            if mine is not None:
                self.groups[key] = mine

    @property
    def params(self) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
        """key -> [(name, parameter)] on this stage, read from the module each time: tensor
        parallelism replaces the tied module (and its parameters) after this object exists."""
        return self.module.tied_parameters()

    @property
    def counted_elsewhere(self) -> set[int]:
        """Ids of this stage's tied parameters that the key's first stage counts in the norm."""
        first = {key: stages[0] for key, stages in self.module.tied_stages.items()}
        return {
            id(p)
            for key, pairs in self.params.items()
            if first[key] != self.module.stage_id
            for _, p in pairs
        }

    def all_params(self) -> list[torch.nn.Parameter]:
        """Every tied parameter of this stage, in key order (the same order on every stage)."""
        return [p for key in sorted(self.params) for _, p in self.params[key]]

    def broadcast(self) -> None:
        """Start every copy from the first stage's values."""
        with torch.no_grad():
            for key, (group, src) in sorted(self.groups.items()):
                for _, p in self.params[key]:
                    comm.broadcast(p.data, src=src, group=group)

    def reduce(self, strategy: GradientStrategy) -> None:
        """Sum the reduced gradient pieces of each tied parameter over the stages holding it."""
        for key, (group, _) in sorted(self.groups.items()):
            for _, p in self.params[key]:
                for piece in strategy.reduced_grads(p):
                    comm.all_reduce(piece, group=group)
