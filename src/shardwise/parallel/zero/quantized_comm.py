"""ZeRO++'s quantized collectives (arXiv 2306.10209) on any backend: torch ops, no kernels.

Both send the uint8 payloads of zero/blockquant.py; the fp32 master shards are never touched.

**qwZ, quantized weights** (``zero_quantized_weights``, stage 3). Each of the N ranks packs
its shard of S elements into int8 + one fp32 scale per block of B = ``WEIGHT_BLOCK``; one
all-gather of the payloads; every rank dequantizes all N of them (its own too, so that every
rank computes with the same weights):

    full[r S : (r+1) S] = dequantize(pack(shard_r))      |error| <= s_k / 2 = max_k|w| / 254

Bytes: S + 4 ceil(S/B) per rank instead of 4 S (fp32): 1/4, plus 1/1024 for the scales.

**qgZ, quantized gradients** (``zero_quantized_gradients``, stages 2 and 3). In place of the
reduce-scatter of the flat gradient g_r (N chunks of S), rank r packs chunk j of g_r in int4
(blocks of ``GRAD_BLOCK``) for rank j; one all-to-all; rank j dequantizes what it received and
sums in fp32, its own chunk taken exact (it never left the rank):

    out_j = g_j[j] + sum_{r != j} dequantize(pack(g_r[j]))
    |out_j - sum_r g_r[j]| <= sum_{r != j} s_{r,k} / 2 <= (N-1) max_r max_k |g_r[j]| / 14

(/ N for the mean). Bytes: (N-1)/N (S/2 + 4 ceil(S/B)) per chunk against (N-1)/N 4 S for a
ring reduce-scatter of fp32: about 1/8. A group of one rank quantizes nothing.

**Two hops** (stage 3, a shard group of n nodes x k ranks whose node groups exist: MiCS's
``mics_hierarchical_params_gather``, zero/mics.py). Shard index g = node b x k + local j.
Hop 1, inside the node (k ranks): rank (a, i) sends local rank j the n chunks of ranks (b, j),
int4; rank (a, j) sums what it got in fp32 (its own exact): partial_b = sum over its node's
ranks of chunk (b, j). Hop 2, across nodes (the n ranks of local index j): partial_b goes to
node b, int4, and is summed there (its own exact):

    |error| <= sum over the k-1 node peers of s_1/2  +  sum over the n-1 other nodes of s_2/2

(s_2 from the partial sums, up to k times larger). Bytes across nodes per rank: (n-1) S/2,
against the (N-k) S/2 of one hop: k times fewer, as the paper's hierarchical scheme.

Only the training gathers are quantized: ``GatheredParameters`` and the consolidated state
dict gather exact values (``Unit.materialize(exact=True)``), except for a unit already gathered
by its module's forward, which they find as it is (quantized).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from shardwise import comm
from shardwise.comm import Group
from shardwise.parallel.zero import blockquant as bq

if TYPE_CHECKING:  # annotations only
    from shardwise.config.zero import ZeroConfig

S = TypeVar("S")  # a stage-3 strategy: anything with ``units``


class QuantizedGather:
    """``(full, shard) -> handle``: the qwZ all-gather through ``base`` (a gather of equal
    byte payloads, ``(out, inp) -> handle``: one all-gather, or MiCS's two hops)."""

    def __init__(self, group: Group, base: Any = None) -> None:
        self.world = comm.get_world_size(group)
        self.base = base or partial(comm.all_gather_into_tensor, group=group, async_op=True)

    def __call__(self, full: torch.Tensor, shard: torch.Tensor) -> Any:
        if self.world == 1:  # nothing travels: nothing to quantize
            return self.base(full, shard)
        payload = bq.pack(shard, bq.WEIGHT_BITS, bq.WEIGHT_BLOCK)
        gathered = torch.empty(self.world * payload.numel(), dtype=torch.uint8, device=full.device)
        work = self.base(gathered, payload)
        return _Unpack(work, gathered.view(self.world, -1), full)


class _Unpack:
    """Waits for the payloads, then dequantizes each rank's into its slice of ``full``."""

    def __init__(self, work: Any, rows: torch.Tensor, full: torch.Tensor) -> None:
        self.work, self.rows, self.full = work, rows, full

    def wait(self) -> None:
        self.work.wait()
        n = self.full.numel() // self.rows.shape[0]  # S, one shard
        for r, row in enumerate(self.rows):
            value = bq.unpack(row, n, bq.WEIGHT_BITS, bq.WEIGHT_BLOCK)
            self.full[r * n : (r + 1) * n].copy_(value)


def quantized_reduce_scatter(out: torch.Tensor, send: torch.Tensor, group: Group) -> Any:
    """Launch qgZ (module docstring): ``out`` (S) = this rank's chunk of the sum over ranks of
    ``send`` (N S), as ``comm.reduce_scatter_tensor`` computes it. Returns a handle."""
    world = comm.get_world_size(group)
    if world == 1:
        return comm.reduce_scatter_tensor(out, send, group=group, async_op=True)
    chunks = send.view(world, -1)
    payload = torch.stack([bq.pack(c, bq.GRAD_BITS, bq.GRAD_BLOCK) for c in chunks])
    received = torch.empty_like(payload)
    work = comm.all_to_all_single(received, payload, group=group, async_op=True)
    own = chunks[comm.get_rank(group)].float()  # exact: it does not travel
    return _Reduce(work, received, own, out, comm.get_rank(group))


def two_hop_reduce_scatter(out: torch.Tensor, send: torch.Tensor, groups: Any) -> Any:
    """qgZ in two hops (module docstring) over ``groups`` (zero/mics.ZeroGroups with
    ``nodes`` > 1: ``intra`` and ``inter`` groups). Blocking; returns a finished handle."""
    n, k = groups.nodes, comm.get_world_size(groups.intra)
    size = out.numel()
    chunks = send.view(n, k, size).transpose(0, 1)  # [j][b]: local rank j's n chunks
    partial = torch.empty(n * size, dtype=torch.float32, device=out.device)
    quantized_reduce_scatter(partial, chunks.reshape(-1), groups.intra).wait()  # hop 1
    final = torch.empty(size, dtype=torch.float32, device=out.device)
    quantized_reduce_scatter(final, partial, groups.inter).wait()  # hop 2
    out.copy_(final)
    return _Finished()


class _Finished:
    def wait(self) -> None:
        pass


class _Reduce:
    """Waits for the all-to-all, then sums the dequantized chunks (and the own exact one)."""

    def __init__(
        self, work: Any, received: torch.Tensor, own: torch.Tensor, out: torch.Tensor, rank: int
    ) -> None:
        self.work, self.received, self.own, self.out, self.rank = work, received, own, out, rank

    def wait(self) -> None:
        self.work.wait()
        total = self.own.clone()
        n = total.numel()
        for r, row in enumerate(self.received):
            if r != self.rank:
                total += bq.unpack(row, n, bq.GRAD_BITS, bq.GRAD_BLOCK)
        self.out.copy_(total)


def quantize_units(strategy: S, group: Group, zero: ZeroConfig) -> S:
    """Stage 3 (``strategy.units``, zero/gathering.py): route the sharded units' forward and
    backward all-gathers through qwZ (``zero_quantized_weights``) and their reduce-scatters
    through qgZ (``zero_quantized_gradients``), over ``group`` (the shard group). Persistent
    units are whole everywhere and all-reduced: as DeepSpeed leaves 1-D tensors unquantized,
    they stay exact. Returns ``strategy``."""
    groups = strategy.groups  # MiCS's node groups (two hops) when it built them
    reduce = (
        partial(two_hop_reduce_scatter, groups=groups)
        if groups.nodes > 1
        else partial(quantized_reduce_scatter, group=group)
    )
    for u in strategy.units:
        if u.persistent:
            continue
        if zero.zero_quantized_weights:
            u.quantized = QuantizedGather(group, u.gather)
        if zero.zero_quantized_gradients:
            u.scatter = reduce
    return strategy
