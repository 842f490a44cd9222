"""Runs of context-parallel attention on every rank, and the single-process reference.

Every rank draws the same full (B, H, S, D) q, k, v and upstream gradient from one seed, keeps
its shard in the balanced layout and returns its output shard, its gradient shards and the
``shardwise.comm`` counters of forward and backward; the test unshards and compares with
``scaled_dot_product_attention`` on the full sequence in one process.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise import comm
from shardwise.parallel.context import context_attention, shard_sequence

B, H, D = 2, 4, 8


def full_inputs(seq_len: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and the upstream gradient of the output, (B, H, S, D) each, seed 0."""
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, seq_len, D, generator=g) for _ in range(4))


def reference(seq_len: int, causal: bool) -> dict[str, torch.Tensor]:
    """Output and q, k, v gradients of plain attention on the full sequence, one process."""
    *qkv, dout = full_inputs(seq_len)
    q, k, v = (x.requires_grad_() for x in qkv)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def context_group(cp: int) -> tuple[dist.ProcessGroup | None, list[int]]:
    """The context group of this rank: the world itself when it has cp ranks, else the
    strided groups {g, g+n, g+2n, ...} (n = world // cp), so that context ranks differ from
    global ranks. Every rank makes every group, in the same order."""
    world = dist.get_world_size()
    if world == cp:
        return None, list(range(cp))
    n = world // cp
    members = [list(range(g, world, n)) for g in range(n)]
    groups = [dist.new_group(m) for m in members]
    mine = dist.get_rank() % n
    return groups[mine], members[mine]


def attention_run(method: str, cp: int, causal: bool, seq_len: int) -> dict:
    """This rank's shard of the output and of the q, k, v gradients, and the comm counters."""
    group, ranks = context_group(cp)
    me = ranks.index(dist.get_rank())
    *full, dout = full_inputs(seq_len)
    q, k, v = (shard_sequence(x, 2, cp, me).requires_grad_() for x in full)
    comm.reset_stats()
    out = context_attention(q, k, v, is_causal=causal, method=method, group=group, ranks=ranks)
    forward = comm.stats()
    comm.reset_stats()
    out.backward(shard_sequence(dout, 2, cp, me))
    backward = comm.stats()
    grads = {"dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {
        "ranks": ranks,
        "cp_rank": me,
        "out": out.detach(),
        **grads,
        "forward": forward,
        "backward": backward,
    }
