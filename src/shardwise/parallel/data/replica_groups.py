"""Which data-parallel ranks hold copies of a parameter.

By default every rank of the data-parallel group holds every parameter. Expert parallelism
(parallel/moe/) splits the experts over ``ep`` data ranks, so an expert's copies are only on
the ranks of its expert-data group (``dp / ep`` ranks). The strategies reduce, broadcast and
shard each parameter over the group recorded here, and average by the whole data-parallel
size N: the expert-data group's sum already holds every data rank's contribution once (the
all-to-all brought each rank's tokens to the expert), so g = (1/N) * sum over its copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.comm import Group

_ATTR = "_shardwise_replicas"


@dataclass(frozen=True)
class Replicas:
    """The process group of the data ranks holding copies of a parameter, and their global
    ranks (the first one is the source of broadcasts)."""

    group: Group
    ranks: tuple[int, ...]
    # Every set of data ranks holding one copy set of the parameters in this parameter's
    # position (the expert-data groups of all expert-parallel ranks), in the same order on
    # every rank: checkpoints pick one writer per set the same way everywhere.
    every: tuple[tuple[int, ...], ...] = ()

    @property
    def sets(self) -> tuple[tuple[int, ...], ...]:
        return self.every or (self.ranks,)


def set_replicas(
    param: torch.Tensor, group: Group, ranks: list[int], every: list[list[int]]
) -> None:
    """Record that only ``ranks`` (a part of the data-parallel group, one of ``every``) hold
    ``param``."""
    setattr(param, _ATTR, Replicas(group, tuple(ranks), tuple(tuple(e) for e in every)))


def has_replicas(param: torch.Tensor) -> bool:
    """Only part of the data-parallel group holds ``param`` (an expert)."""
    return getattr(param, _ATTR, None) is not None


def get_replicas(param: torch.Tensor, group: Group, ranks: list[int]) -> Replicas:
    """The recorded replicas, or the whole data-parallel ``group`` of ``ranks``."""
    found = getattr(param, _ATTR, None)
    return found if found is not None else Replicas(group, tuple(ranks))


def partition_by_replicas(
    params: list[torch.nn.Parameter], group: Group, ranks: list[int]
) -> list[tuple[Replicas, list[torch.nn.Parameter]]]:
    """``params`` split by the group their copies live on, each list in the given order; the
    whole data-parallel group first, then the others in order of first appearance."""
    out: dict[tuple[int, ...], tuple[Replicas, list]] = {
        tuple(ranks): (Replicas(group, tuple(ranks)), [])
    }
    for p in params:
        rep = get_replicas(p, group, ranks)
        out.setdefault(rep.ranks, (rep, []))[1].append(p)
    return [(rep, ps) for rep, ps in out.values() if ps]
