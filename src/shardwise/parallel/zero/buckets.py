"""The records ZeRO stages 1-2 (stage12.py) keep per bucket: where its parameters live (which
data ranks, which shard is this rank's) and the buffers of its reduction in flight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.comm import Group
from shardwise.parallel.flat import FlatLayout


@dataclass(frozen=True)
class Where:
    """The data ranks holding a bucket's parameters (all of them, or an expert-data group:
    data/replica_groups.py): their group, its size, this rank's shard index and the shard count."""

    group: Group
    size: int
    shard: int  # this rank's shard (0 when not sharded)
    parts: int


@dataclass
class Bucket:
    where: Where
    layout: FlatLayout
    params_flat: torch.Tensor  # the whole bucket's parameters (compute dtype); params are views
    master: torch.nn.Parameter  # this rank's shard in fp32 (a view of params_flat when it can be)
    grads_flat: torch.Tensor | None = None  # stage 1: persistent; stage 2: transient send buffer
    grad_shard: torch.Tensor | None = None  # this rank's reduced gradient shard
    work: Any = None
    out: torch.Tensor | None = None
    ready: set = field(default_factory=set)
    sent: bool = False  # launched during this backward (stage 2 drains some early)
