"""Master weights: the fp32 (or offloaded) copies ZeRO steps instead of the parameters.

ZeRO-1/2 buckets and ZeRO-3 units each hold this rank's shard of a flat buffer and its master
(``holder.master``, an ``nn.Parameter``); the user's optimizer is pointed at the masters, each of
its parameter groups keeping its hyper-parameters, so an elementwise optimizer (SGD, Adam, AdamW,
Adagrad...) computes exactly what it computes unsharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are views of one storage (a master that is the parameters' own shard,
    fp32 without offload: it costs nothing and is not saved separately)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata  # fake tensors too


def rebind_optimizer(
    optimizer: torch.optim.Optimizer, holders: Sequence[Any], group_of: dict[int, int]
) -> torch.optim.Optimizer:
    """The user's optimizer itself, its groups now over this rank's master shards.

    DeepSpeed's contract: ZeRO steps the optimizer the user built, so its ``param_groups``
    stay the live hyper-parameters. A learning-rate scheduler built on it before
    ``initialize`` (Accelerate's ``prepare`` keeps such a torch scheduler and steps it itself)
    goes on moving the learning rate that is used; a new optimizer would leave it moving a
    copy. Only ``params`` changes in each group; the state of the replaced parameters goes.
    """
    masters = [
        [h.master for h in holders if group_of[id(h.layout.params[0])] == gi]
        for gi in range(len(optimizer.param_groups))
    ]
    for g, mine in zip(optimizer.param_groups, masters, strict=True):
        g["params"] = mine
    optimizer.state.clear()  # keyed by the replaced parameters: their state would stay alive
    return optimizer
