"""Ring attention: the sequence axis is split, queries stay home, keys and values travel.

Legend: B batch, H heads, s = S/cp local tokens (two chunks of c = s/2, token_order.py), D head_dim.
Each rank keeps its queries q (B, H, s, D) and passes its K/V block (B, H, s, D) round the
ring of the context group (rank i sends to i+1, receives from i-1): after cp-1 transfers every
query has met every key. Per block the rank computes, in fp32,

    S_b = q k_b^T * scale,   lse_b = logsumexp(S_b),   O_b = softmax(S_b) v_b

and folds it into the running (O, lse) with the online-softmax update

    lse' = log(exp(lse) + exp(lse_b)),   O' = O * exp(lse - lse') + O_b * exp(lse_b - lse')

so the result is softmax over all keys without ever holding the (s, S) score matrix. On CPU
each block runs torch's fused flash-attention kernel (tiled, no (s, s) score matrix either):
forward + backward 9-12x faster than the plain matmuls other devices use (s = 2048-4096, 4 heads
of 32, one thread). Causal masking goes by global chunk id: a key chunk earlier than the query chunk is attended
in full, the same chunk gets the causal diagonal, a later one is skipped (no compute).

Backward (flash-attention style) goes round the same ring with the saved O and lse:
P = exp(S - lse), D = rowsum(dO * O), dV = P^T dO, dS = P * (dO V^T - D), dQ = dS K * scale,
dK = dS^T Q * scale (on CPU: the fused kernel's backward, given the final O and lse). dK/dV
partials (fp32) travel with their K/V block; after the last block a final hop takes them home. Per rank: forward cp-1 K and cp-1 V blocks sent; backward cp-1 K/V
pairs plus cp dK/dV pairs.

O is kept as (B, s, H, D) in memory, viewed (B, H, s, D): a model that puts the heads side by side
again (``transpose(1, 2).flatten(2)``, as after ``scaled_dot_product_attention``) gets a view, so
the tensor the next projection saves for backward is the one this function saves, not a copy.

Under torch.compile the same forward and backward run as two custom ops (``ring_forward_op``,
``ring_backward_op``, the second the first's autograd formula; docs/compile.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.autograd.function import FunctionCtx

from shardwise import comm
from shardwise.parallel.context.token_order import check_shards, chunk_ids, context_rank
from shardwise.parallel.tensor.comm_ops import group_name, resolve_group

_Block = tuple[slice, slice, bool]  # (query rows, key rows, causal diagonal)
_ALL = slice(None)


class _Ring(NamedTuple):
    """Where this rank sits in the context group: neighbours are global ranks."""

    group: comm.Group
    prev: int
    next: int
    me: int  # context-parallel rank
    cp: int


def _chunks(cp: int, cp_rank: int, n: int) -> list[tuple[int, slice]]:
    """(global chunk id, local slice) of the chunks ``cp_rank`` holds; one chunk if cp == 1."""
    if cp == 1:
        return [(0, slice(0, n))]
    c = n // 2
    first, second = chunk_ids(cp, cp_rank)
    return [(first, slice(0, c)), (second, slice(c, n))]


def _blocks(q_chunks: list, k_chunks: list, causal: bool) -> list[_Block]:
    """The (query, key) sub-blocks to compute for one K/V block, by global chunk id.

    Under the balanced token order this is half of the block on every step but the home one: a
    block from an earlier rank is needed by both query chunks against its first key chunk, one
    from a later rank by the late query chunk against both of its key chunks. Two full blocks
    that share one side are merged into one matmul."""
    if not causal:
        return [(_ALL, _ALL, False)]
    out: list[_Block] = []
    for qi, qs in q_chunks:
        for ki, ks in k_chunks:
            if ki <= qi:
                out.append((qs, ks, ki == qi))
    if len(out) == 2 and not (out[0][2] or out[1][2]):
        (q0, k0, _), (q1, k1, _) = out
        if k0 == k1 and q0.stop == q1.start:
            return [(slice(q0.start, q1.stop), k0, False)]
        if q0 == q1 and k0.stop == k1.start:
            return [(q0, slice(k0.start, k1.stop), False)]
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    """S = q k^T * scale (B, H, sq, sk), fp32; on the diagonal a key after its query is -inf."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if diagonal:  # square: the same chunk on both sides
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _fused(t: torch.Tensor) -> bool:
    """torch's fused CPU flash-attention kernels serve this device (forward and backward).
    They are private operators: a torch without them takes the plain path."""
    return t.device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_b (B, H, sq, D), lse_b (B, H, sq)) of one sub-block, fp32 in and out."""
    if _fused(q):  # is_causal on a square block is the diagonal's mask
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, diagonal, scale=scale
        )
    s = _scores(q, k, scale, diagonal)
    l_b = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - l_b.unsqueeze(-1)), v), l_b


def _merge(
    out: torch.Tensor, lse: torch.Tensor, rows: slice, o_b: torch.Tensor, l_b: torch.Tensor
) -> None:
    """Online softmax: fold block (o_b, l_b) into rows of the running (out, lse), in place."""
    old = lse[..., rows]
    new = torch.logaddexp(old, l_b)  # old = -inf (nothing seen yet) gives new = l_b
    keep, take = torch.exp(old - new).unsqueeze(-1), torch.exp(l_b - new).unsqueeze(-1)
    out[..., rows, :] = out[..., rows, :] * keep + o_b * take
    lse[..., rows] = new


def _post(tensors: Sequence[torch.Tensor], ring: _Ring, tag: int = 0) -> tuple[list, list]:
    """Receive like-shaped buffers from the previous rank, send ``tensors`` (contiguous, not
    written until the works are waited on) to the next one; returns (buffers, works). Each
    tensor has its own tag so two in flight between the same pair never mix."""
    bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    works = [comm.irecv(b, ring.prev, ring.group, tag=tag + i) for i, b in enumerate(bufs)]
    works += [comm.isend(t, ring.next, ring.group, tag=tag + i) for i, t in enumerate(tensors)]
    return bufs, works


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, ring: _Ring, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O fp32 (B, H, s, D), lse fp32 (B, H, s)) of the local queries against every block."""
    me, cp = ring.me, ring.cp
    qf = q.float()
    b, h, s, d = q.shape[:-1] + v.shape[-1:]
    # (B, s, H, D) in memory (module doc): the heads-side-by-side view costs no copy
    out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    q_chunks = _chunks(cp, me, q.shape[-2])
    kv = [k.contiguous(), v.contiguous()]
    for step in range(cp):
        # Post the next transfer first: the block travels while this one is computed.
        incoming, works = _post(kv, ring) if step < cp - 1 else ([], [])
        k_chunks = _chunks(cp, (me - step) % cp, k.shape[-2])
        for rows, keys, diagonal in _blocks(q_chunks, k_chunks, causal):
            kb, vb = kv[0][..., keys, :].float(), kv[1][..., keys, :].float()
            o_b, l_b = _attend(qf[..., rows, :], kb, vb, scale, diagonal)
            _merge(out, lse, rows, o_b, l_b)
        _wait(works)
        kv = incoming or kv
    return out, lse


def _block_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    diagonal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one sub-block, all fp32: the flash-attention backward of P = exp(S - lse),
    with ``out`` and ``lse`` those of the whole softmax (every block merged)."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, diagonal, scale=scale
        )
    delta = (do * out).sum(-1)  # D = rowsum(dO * O) (B, H, sq)
    p = torch.exp(_scores(q, k, scale, diagonal) - lse.unsqueeze(-1))  # masked: exp(-inf) = 0
    dv = torch.matmul(p.transpose(-2, -1), do)
    ds = p * (torch.matmul(do, v.transpose(-2, -1)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def _backward(
    saved: Sequence[torch.Tensor], dout: torch.Tensor, causal: bool, ring: _Ring, scale: float
) -> tuple[torch.Tensor, ...]:
    """dq of the local queries; dk, dv of the local block, gathered from every rank.
    ``saved``: forward's (q, k, v, O, lse)."""
    q, k, v, out, lse = saved
    me, cp = ring.me, ring.cp
    qf, do = q.float(), dout.float()
    dq = torch.zeros_like(qf)
    kv = [k.contiguous(), v.contiguous()]
    # contiguous whatever k's strides (a transposed view): they are sent as they are
    dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
    q_chunks = _chunks(cp, me, q.shape[-2])
    for step in range(cp):
        incoming, works = _post(kv, ring) if step < cp - 1 else ([], [])
        k_chunks = _chunks(cp, (me - step) % cp, k.shape[-2])
        for rows, keys, diagonal in _blocks(q_chunks, k_chunks, causal):
            kb, vb = kv[0][..., keys, :].float(), kv[1][..., keys, :].float()
            args = (do[..., rows, :], out[..., rows, :], lse[..., rows], scale, diagonal)
            dq_b, dk_b, dv_b = _block_grads(qf[..., rows, :], kb, vb, *args)
            dq[..., rows, :] += dq_b
            dkv[0][..., keys, :] += dk_b
            dkv[1][..., keys, :] += dv_b
        if cp > 1:  # the partials follow their block; the last hop takes them home
            dkv_in, dworks = _post(dkv, ring, tag=2)
            _wait(works + dworks)
            dkv = dkv_in
        kv = incoming or kv
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        ring: _Ring,
        scale: float,
    ) -> torch.Tensor:
        out, lse = _forward(q, k, v, causal, ring, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple:
        grads = _backward(ctx.saved_tensors, dout, ctx.causal, ctx.ring, ctx.scale)
        return (*grads, None, None, None)


# Under torch.compile the ring is two custom ops (forward, backward), one opaque node each in
# the forward and backward graphs (tensor/comm_ops.py's pattern): dynamo cannot trace
# isend/irecv nor comm.py's accounting, which broke every block's graph at each hop. The
# ring travels as plain values: the group by name, neighbours as global ranks.


def _ring_of(group: str, prev: int, nxt: int, me: int, cp: int) -> _Ring:
    return _Ring(resolve_group(group), prev, nxt, me, cp)


@torch.library.custom_op("shardwise::ring_attention", mutates_args=())
def ring_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    group: str,
    prev: int,
    nxt: int,
    me: int,
    cp: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O fp32, lse fp32) of ``_forward``: O (B, H, s, D) laid out (B, s, H, D) in memory."""
    return _forward(q, k, v, causal, _ring_of(group, prev, nxt, me, cp), scale)


@ring_forward_op.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, s, d = q.shape[:-1] + v.shape[-1:]
    out = q.new_empty(b, s, h, d, dtype=torch.float32).transpose(1, 2)
    return out, q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("shardwise::ring_attention_backward", mutates_args=())
def ring_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    group: str,
    prev: int,
    nxt: int,
    me: int,
    cp: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``_backward``, contiguous."""
    ring = _ring_of(group, prev, nxt, me, cp)
    grads = _backward((q, k, v, out, lse), dout, causal, ring, scale)
    return tuple(g.contiguous() for g in grads)


@ring_backward_op.register_fake
def _(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, *ctx.args = inputs
    ctx.save_for_backward(q, k, v, *output)


def _op_backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor) -> tuple:
    grads = ring_backward_op(dout, *ctx.saved_tensors, *ctx.args)  # lse's gradient: none
    return (*grads, *(None for _ in ctx.args))


ring_forward_op.register_autograd(_op_backward, setup_context=_setup)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    group: comm.Group,
    ranks: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale [+ causal mask]) V over the whole sequence, for this rank's queries.

    q, k, v: this rank's (B, H, S/cp, D) shard in the balanced token order (token_order.py), same heads;
    ``ranks``: the global ranks of ``group`` in context-parallel order. Returns (B, H, S/cp, D)
    in the same layout and dtype as q. ``scale`` defaults to 1/sqrt(D), as
    ``scaled_dot_product_attention``. Differentiable with respect to q, k and v.
    """
    cp = len(ranks)
    check_shards(q, k, v, cp)
    me = context_rank(ranks)
    ring = _Ring(group, ranks[(me - 1) % cp], ranks[(me + 1) % cp], me, cp)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if torch.compiler.is_compiling():  # one opaque node in the graph (above)
        args = (causal, group_name(ring.group), ring.prev, ring.next, me, cp, scale)
        return ring_forward_op(q, k, v, *args)[0].to(q.dtype)
    return _RingAttention.apply(q, k, v, causal, ring, scale)
