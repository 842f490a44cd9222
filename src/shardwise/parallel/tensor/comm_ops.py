"""The collectives of tensor parallelism as custom ops, for code torch.compile traces.

Inside a compiled block, comm.py's collectives (byte accounting, the flight recorder, gloo's
Python API) would each break the graph. Wrapped as ``torch.library.custom_op``\\ s they are one
opaque node each: dynamo records the call, AOTAutograd keeps it in the forward or backward
graph, Inductor calls it at run time, and the op runs ``shardwise.comm`` eagerly (so the call
is counted and recorded as in eager mode). The group travels as its name (ops take no Python
objects) and is looked up again by torch.distributed.

Each op returns a new tensor (a custom op may not return an alias of its input); the
autograd functions of comm.py call them only under ``torch.compiler.is_compiling()``, so
eager runs are unchanged. ``register_fake`` gives the output's shape from the input's and the
group size, which is all the compiler needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from shardwise import comm

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup


def group_name(group: ProcessGroup | None) -> str:
    """The name an op is given for ``group`` (None: the world)."""
    return (group if group is not None else dist.group.WORLD).group_name


def resolve_group(name: str) -> ProcessGroup:
    """The process group named ``name`` (``group_name``'s inverse)."""
    return _resolve_process_group(name)


REDUCE_OPS = {"sum": comm.ReduceOp.SUM, "max": comm.ReduceOp.MAX}


@torch.library.custom_op("shardwise::tp_all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """The sum (``op`` "max": the maximum) over the group of every rank's ``x``."""
    out = torch.clone(x, memory_format=torch.contiguous_format)
    comm.all_reduce(out, op=REDUCE_OPS[op], group=resolve_group(group))
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("shardwise::tp_all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group: str) -> torch.Tensor:
    """Every rank's ``x`` flattened, concatenated in rank order: (n * x.numel(),)."""
    g = resolve_group(group)
    out = torch.empty(g.size() * x.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, x.contiguous().view(-1), group=g)
    return out


@all_gather.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return x.new_empty(resolve_group(group).size() * x.numel())


@torch.library.custom_op("shardwise::tp_reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, group: str) -> torch.Tensor:
    """Chunk r of the flat sum over the group of every rank's ``x``: (x.numel() / n,)."""
    g = resolve_group(group)
    out = torch.empty(x.numel() // g.size(), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, x.contiguous().view(-1), group=g)
    return out


@reduce_scatter.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return x.new_empty(x.numel() // resolve_group(group).size())
