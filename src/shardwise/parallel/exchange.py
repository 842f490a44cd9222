"""The differentiable all-to-all, shared by expert parallelism and Ulysses.

Forward: dim 0 of ``x`` is cut into one equal chunk per rank of ``group``; chunk j goes to rank
j, and rank i's chunk lands at position i of the result. MoE sends the (E, C, M) dispatched
tokens, ``ep`` chunks of E/ep experts each (parallel/moe/layer.py). Ulysses sends a sequence
shard cut by head groups (parallel/context/ulysses.py). The exchange is its own inverse, so
backward sends the gradient back the same way. Counted by ``shardwise.comm`` (op ``all_to_all``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx

from shardwise import comm


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, group: comm.Group, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.group, grad)


def all_to_all(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Equal chunks of dim 0 of ``x`` exchanged over ``group`` (differentiable)."""
    return _AllToAll.apply(group, x)
