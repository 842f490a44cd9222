"""Master weights: the fp32 (or offloaded) copies ZeRO steps instead of the parameters.

ZeRO-1/2 buckets and ZeRO-3 units each hold this rank's shard of a flat buffer and its master
(``holder.master``, an ``nn.Parameter``); the user's optimizer is rebuilt over the masters with
the same class and hyper-parameters per parameter group, so an elementwise optimizer (SGD,
Adam, AdamW, Adagrad...) computes exactly what it computes unsharded.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are views of one storage (a master that is the parameters' own shard,
    fp32 without offload: it costs nothing and is not saved separately)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata  # fake tensors too


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, holders: Sequence[Any], group_of: dict[int, int]
) -> torch.optim.Optimizer:
    """The same optimizer class and hyper-parameters, over this rank's master shards."""
    groups = []
    for gi, g in enumerate(optimizer.param_groups):
        masters = [h.master for h in holders if group_of[id(h.layout.params[0])] == gi]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": masters})
    # Every hyper-parameter travels in the groups; the constructor only needs the ones it takes.
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(groups, **defaults)
