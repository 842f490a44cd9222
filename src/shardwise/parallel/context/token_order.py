"""The load-balanced token order of context parallelism: which tokens each rank holds.

The global sequence of length S is cut into 2*cp equal chunks of c = S / (2*cp) tokens;
context-parallel rank r (0 <= r < cp) holds chunks r and 2*cp-1-r, concatenated in that order:

    S = 16, cp = 2:  chunks 0 1 2 3  ->  rank 0: [0, 3]   rank 1: [1, 2]

Under a causal mask query chunk i attends to i+1 chunks, so a rank holding one early and one
late chunk does (r+1) + (2*cp-r) = 2*cp+1 chunk pairs of work, the same on every rank; a plain
contiguous split would leave the last rank with ~2*cp-1 times the first rank's work. Both
methods (ring.py, ulysses.py) take their inputs and give their outputs in this order. With
cp == 1 every function here is the identity and the sequence length is free.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise import comm


def check_sequence(seq_len: int, cp: int) -> None:
    """Raise ``ValueError`` unless ``seq_len`` splits into 2*cp equal chunks (cp > 1)."""
    if cp > 1 and seq_len % (2 * cp) != 0:
        raise ValueError(
            f"context_parallel.size={cp} needs a sequence length divisible by 2*{cp}={2 * cp}, "
            f"got {seq_len}: each rank holds two chunks (one early, one late) so that causal "
            f"attention costs every rank the same. Pad the sequence to a multiple of {2 * cp} "
            f"(next: {-(-seq_len // (2 * cp)) * 2 * cp}) or change context_parallel.size."
        )


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunk indices held by ``cp_rank``: (r, 2*cp-1-r)."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} is outside context_parallel.size={cp}")
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(tensor: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This rank's two chunks of ``tensor`` along ``dim``, concatenated, contiguous
    (length ``tensor.shape[dim] // cp``)."""
    check_sequence(tensor.shape[dim], cp)
    if cp == 1:
        return tensor.contiguous()
    chunks = tensor.chunk(2 * cp, dim=dim)
    first, second = chunk_ids(cp, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim).contiguous()


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int, cp: int) -> torch.Tensor:
    """The global tensor from every rank's shard (rank order): the inverse of
    ``shard_sequence``. Chunk m < cp is the first half of rank m's shard; chunk m >= cp the
    second half of rank 2*cp-1-m's."""
    if len(shards) != cp:
        raise ValueError(f"unshard_sequence needs {cp} shards (one per rank), got {len(shards)}")
    if cp == 1:
        return shards[0]
    halves = [s.chunk(2, dim=dim) for s in shards]
    early = [h[0] for h in halves]  # chunks 0 .. cp-1
    late = [h[1] for h in reversed(halves)]  # chunks cp .. 2cp-1
    return torch.cat(early + late, dim=dim)


def sequence_positions(
    seq_len: int, cp: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions (int64) of this rank's tokens, in its local order (length
    ``seq_len // cp``): what rotary embeddings and position ids need under this order."""
    check_sequence(seq_len, cp)
    if cp == 1:
        return torch.arange(seq_len, device=device)
    c = seq_len // (2 * cp)
    first, second = chunk_ids(cp, cp_rank)
    return torch.cat(
        [
            torch.arange(first * c, (first + 1) * c, device=device),
            torch.arange(second * c, (second + 1) * c, device=device),
        ]
    )


def check_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> None:
    """Raise ``ValueError`` unless q, k, v are (B, H, s, D) shards of one layout, same heads."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(
            "context-parallel attention takes q, k, v as (batch, heads, seq/cp, head_dim); "
            f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        raise ValueError(
            f"context-parallel attention needs the same number of heads in q, k and v, got "
            f"{q.shape[1]}, {k.shape[1]}, {v.shape[1]}: repeat the key/value heads first"
        )
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q, k, v shapes do not match: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q holds {q.shape[2]} tokens and k/v {k.shape[2]}: both must be this rank's "
            "shard of the same sequence"
        )
    check_sequence(q.shape[2] * cp, cp)


def context_rank(ranks: Sequence[int]) -> int:
    """This process's context-parallel rank: its index in ``ranks`` (0 when cp == 1)."""
    if len(ranks) == 1:
        return 0
    rank = comm.get_rank()
    if rank not in ranks:
        raise ValueError(f"global rank {rank} is not in the context group {list(ranks)}")
    return list(ranks).index(rank)
