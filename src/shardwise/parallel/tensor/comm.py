"""The collectives of tensor and sequence parallelism, as autograd functions.

Each function is a pair (forward, backward) of conjugate communications, over an explicit
tensor-parallel ``group`` of n ranks, r this rank. Megatron-LM (arXiv 1909.08053, Code 1):

    copy_to_tp        f   forward identity         backward all-reduce (sum)
    reduce_from_tp    g   forward all-reduce       backward identity
    scatter_to_tp         forward keep chunk r     backward all-gather        (along ``dim``)
    gather_from_tp        forward all-gather       backward keep chunk r      (along ``dim``)

Sequence parallelism (Korthikanti et al., arXiv 2205.05198 §4.2) replaces each all-reduce by
a reduce-scatter plus an all-gather along the sequence dimension (dim 1 of batch-first
(B, T, C) activations, the ``seq_dim`` default):

    gather_from_sequence        forward all-gather   backward reduce-scatter (grads are partial)
    reduce_scatter_to_sequence  forward reduce-scatter   backward all-gather
    scatter_to_sequence         forward keep chunk r     backward all-gather

All traffic goes through ``shardwise.comm`` (counted in ``comm.stats()``); a group of one
process makes every function the identity. Collectives never write into a tensor autograd
handed in: backward gradients are often shared between branches (the two inputs of a residual
add receive the same tensor), so every reduction works on a copy.

``sum_grad_over_tp`` is the parameter-side companion: a parameter that sees only part of the
activations (a norm weight on a sequence shard) gets the sum of every rank's gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardwise import comm
from shardwise.parallel.flat import ceil_div
from shardwise.parallel.tensor import comm_ops

if TYPE_CHECKING:  # annotations only
    from torch.autograd.function import FunctionCtx
    from torch.distributed import ProcessGroup


def _size(group: ProcessGroup | None) -> int:
    return comm.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if _size(group) == 1:
        return x
    if torch.compiler.is_compiling():  # one opaque node in the graph (comm_ops.py)
        return comm_ops.all_reduce(x, comm_ops.group_name(group))
    out = torch.clone(x, memory_format=torch.contiguous_format)
    comm.all_reduce(out, group=group)
    return out


def _check_split(x: torch.Tensor, dim: int, n: int, what: str) -> int:
    if x.shape[dim] % n:
        raise ValueError(
            f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} has size "
            f"{x.shape[dim]}, not divisible by the tensor-parallel size {n}; for sequence "
            "parallelism make the sequence length a multiple of tensor_parallel.size"
        )
    return x.shape[dim] // n


def _split(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Chunk ``rank`` of ``n`` equal chunks along ``dim`` (a copy, not a view)."""
    n = _size(group)
    if n == 1:
        return x
    s = _check_split(x, dim, n, "split")
    return torch.clone(
        x.narrow(dim, comm.get_rank(group) * s, s), memory_format=torch.contiguous_format
    )


def _gather(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    n = _size(group)
    if n == 1:
        return x
    if torch.compiler.is_compiling():
        flat = comm_ops.all_gather(x, comm_ops.group_name(group))
    else:
        flat = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
        comm.all_gather_into_tensor(flat, x.contiguous().view(-1), group=group)
    # (n, *shape) -> rank axis next to dim -> merged: index r * s + i, the concatenation.
    return flat.view(n, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Chunk ``rank`` along ``dim`` of the sum over ranks of ``x``."""
    n = _size(group)
    if n == 1:
        return x
    s = _check_split(x, dim, n, "reduce-scatter")
    # (.., n*s, ..) -> (n, .., s, ..): chunk r of the flat buffer is rank r's slice along dim.
    stacked = x.unflatten(dim, (n, s)).movedim(dim, 0).contiguous()
    if torch.compiler.is_compiling():
        return comm_ops.reduce_scatter(stacked, comm_ops.group_name(group)).view(stacked.shape[1:])
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out.view(-1), stacked.view(-1), group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple:
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, group: ProcessGroup | None, dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """Forward all-gather; backward keeps chunk r (``reduce_grad=False``: every rank's output
    gradient is the whole gradient) or reduce-scatters (``reduce_grad=True``: each rank's
    output gradient is a partial sum, as when the gathered tensor feeds a column split)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, group: ProcessGroup | None, dim: int, reduce_grad: bool
    ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple:
        if ctx.reduce_grad:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, group: ProcessGroup | None, dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple:
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """f: identity forward; backward sums the input gradient over the group (each rank's
    gradient is the partial sum from its own slice of the next layer's weight)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """g: forward sums the partial outputs over the group; backward identity."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Forward: this rank's chunk of ``x`` along ``dim``; backward: all-gather."""
    return _Scatter.apply(x, group, dim % x.dim())


def gather_from_tp(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """Forward: all-gather along ``dim``; backward: this rank's chunk of the gradient."""
    return _Gather.apply(x, group, dim % x.dim(), False)


def scatter_to_sequence(
    x: torch.Tensor, group: ProcessGroup | None, seq_dim: int = 1
) -> torch.Tensor:
    """Enter the sequence-parallel region: keep this rank's T/n positions of a replicated
    tensor; backward all-gathers the positions' gradients (replicated again)."""
    return _Scatter.apply(x, group, seq_dim % x.dim())


def gather_from_sequence(
    x: torch.Tensor, group: ProcessGroup | None, seq_dim: int = 1, reduce_grad: bool = True
) -> torch.Tensor:
    """All-gather the sequence shards (B, T/n, C) -> (B, T, C). Backward reduce-scatters the
    gradient when it is a partial sum (the gathered tensor feeds a column-parallel layer),
    or keeps this rank's chunk with ``reduce_grad=False`` (the gradient is whole)."""
    return _Gather.apply(x, group, seq_dim % x.dim(), reduce_grad)


def reduce_scatter_to_sequence(
    x: torch.Tensor, group: ProcessGroup | None, seq_dim: int = 1
) -> torch.Tensor:
    """Sum the partial outputs over the group, each rank keeping its T/n positions
    (B, T, C) -> (B, T/n, C); backward all-gathers."""
    return _ReduceScatter.apply(x, group, seq_dim % x.dim())


def sum_grad_over_tp(param: torch.Tensor, group: ProcessGroup | None) -> None:
    """Make ``param``'s gradient the sum over the group of every rank's gradient.

    For parameters applied to a sequence shard (norm weights and biases, the bias of a
    sequence-parallel row layer): each rank's gradient covers only its T/n positions. The hook
    runs on the gradient before it is accumulated into ``.grad``, so data-parallel hooks
    (which fire after accumulation) already see the full gradient. Registered once per
    parameter, however often it is asked for.
    """
    if _size(group) == 1 or getattr(param, "_shardwise_tp_grad_sum", False):
        return
    param.register_hook(lambda grad: _all_reduce(grad, group))
    param._shardwise_tp_grad_sum = True


def chunk_numel(numel: int, group: ProcessGroup | None) -> int:
    """Elements of each rank's ``flat_chunk`` of a tensor of ``numel``: ceil(numel / N)."""
    return ceil_div(numel, comm.get_world_size(group))


def flat_chunk(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Chunk ``rank`` of ``x`` flattened and zero-padded to N equal chunks of ceil(numel / N)
    elements: a copy (a view would keep the whole storage alive). For a tensor every rank of
    ``group`` holds whole, so that each keeps or sends only its 1/N."""
    size, rank = chunk_numel(x.numel(), group), comm.get_rank(group)
    piece = x.detach().reshape(-1)[rank * size : (rank + 1) * size]
    out = torch.zeros(size, dtype=x.dtype, device=x.device)
    out[: piece.numel()] = piece
    return out


def unflat_gather(chunk: torch.Tensor, shape: Any, group: ProcessGroup | None) -> torch.Tensor:
    """The whole tensor of ``shape`` back from every rank's ``flat_chunk``: one all-gather,
    the padding dropped. Exact: an all-gather copies bytes."""
    n = comm.get_world_size(group)
    full = torch.empty(n * chunk.numel(), dtype=chunk.dtype, device=chunk.device)
    comm.all_gather_into_tensor(full, chunk, group=group)
    return full[: torch.Size(shape).numel()].view(shape)
