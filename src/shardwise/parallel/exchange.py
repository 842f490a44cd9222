"""The differentiable all-to-all, shared by expert parallelism and Ulysses.

Forward: dim 0 of ``x`` is cut into one equal chunk per rank of ``group``; chunk j goes to rank
j, and rank i's chunk lands at position i of the result. MoE sends the (E, C, M) dispatched
tokens, ``ep`` chunks of E/ep experts each (parallel/moe/layer.py). Ulysses sends a sequence
shard cut by head groups (parallel/context/ulysses.py). The exchange is its own inverse, so
backward sends the gradient back the same way. Counted by ``shardwise.comm`` (op ``all_to_all``).

Under torch.compile the exchange is the custom op ``shardwise::all_to_all`` (as tensor
parallelism's collectives, tensor/comm_ops.py): one opaque node in the forward graph and one
in the backward graph (its autograd formula is the op again), running ``shardwise.comm``
eagerly, so byte counts and the flight recorder see it as in eager mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import FunctionCtx

from shardwise import comm
from shardwise.parallel.tensor.comm_ops import group_name, resolve_group


def _exchange(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, group: comm.Group, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.group, grad)


@torch.library.custom_op("shardwise::all_to_all", mutates_args=())
def all_to_all_op(x: torch.Tensor, group: str) -> torch.Tensor:
    """``all_to_all`` for compiled code: ``group`` is the group's name (ops take no objects)."""
    return _exchange(x, resolve_group(group))


@all_to_all_op.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.group = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return all_to_all_op(grad, ctx.group), None  # the exchange is its own inverse


all_to_all_op.register_autograd(_backward, setup_context=_setup)


def all_to_all(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """Equal chunks of dim 0 of ``x`` exchanged over ``group`` (differentiable)."""
    if torch.compiler.is_compiling():  # one opaque node in the graph (module doc)
        return all_to_all_op(x, group_name(group))
    return _AllToAll.apply(group, x)
