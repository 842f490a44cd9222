"""The all-to-all of expert parallelism, as an autograd function.

Forward: the (E, C, M) dispatched tokens are cut along E into ``ep`` equal chunks (chunk j: the
experts of expert-parallel rank j) and chunk j goes to rank j; each rank receives, from every
rank i, its tokens for this rank's E/ep experts: (ep, E/ep, C, M) stacked as (E, C, M). The
exchange is its own inverse, so backward sends the gradient back the same way. Counted by
``shardwise.comm`` (op ``all_to_all``).
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
