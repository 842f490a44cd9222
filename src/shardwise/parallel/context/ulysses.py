"""Ulysses attention: trade the sequence split for a head split, attend locally, trade back.

Legend: B batch, H heads, s = S/cp local tokens, Hc = H/cp heads per rank, D head_dim.
Attention is independent per head, so one all-to-all per tensor turns each rank's
(B, H, s, D) sequence shard (balanced token order, token_order.py) into (B, Hc, S, D): all S tokens of
its Hc heads, put back in natural sequence order. Then plain
``scaled_dot_product_attention`` runs with the usual causal mask, and one all-to-all takes the
output (B, Hc, S, D) back to (B, H, s, D) in the balanced token order. Exactly four all-to-alls per
forward (q, k, v, out), each of B*H*s*D elements per rank; backward runs the inverse
exchanges on the gradients (four more). Needs H divisible by cp.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import comm
from shardwise.config import ConfigError
from shardwise.parallel.context.token_order import check_shards, context_rank
from shardwise.parallel.exchange import all_to_all

# where models keep their query-head count (key/value head counts are not these)
QUERY_HEAD_ATTRS = ("num_attention_heads", "n_head", "n_heads", "num_heads")


def _to_heads(x: torch.Tensor, cp: int, group: comm.Group) -> torch.Tensor:
    """(B, H, s, D) balanced sequence shard -> (B, Hc, S, D), natural sequence order."""
    b, h, s, d = x.shape
    c = s // 2
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # head group j -> rank j
    got = all_to_all(send, group)  # (cp, B, Hc, s, D): rank i's tokens of my heads
    got = got.reshape(cp, b, h // cp, 2, c, d)
    # Rank i holds chunks i and 2cp-1-i: first halves in rank order are chunks 0..cp-1,
    # second halves in reverse rank order are chunks cp..2cp-1.
    chunks = torch.cat([got[:, :, :, 0], got[:, :, :, 1].flip(0)])  # (2cp, B, Hc, c, D)
    return chunks.permute(1, 2, 0, 3, 4).reshape(b, h // cp, 2 * cp * c, d)


def _to_sequence(y: torch.Tensor, cp: int, group: comm.Group) -> torch.Tensor:
    """(B, Hc, S, D) natural order -> (B, H, s, D) balanced sequence shard: _to_heads inverted."""
    b, hc, seq, d = y.shape
    c = seq // (2 * cp)
    chunks = y.reshape(b, hc, 2 * cp, c, d).permute(2, 0, 1, 3, 4)  # (2cp, B, Hc, c, D)
    send = torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim=3)  # (cp, B, Hc, 2, c, D)
    got = all_to_all(send.reshape(cp, b, hc, 2 * c, d), group)  # rank i: its heads
    return got.transpose(0, 1).reshape(b, cp * hc, 2 * c, d)


def check_heads(heads: int, cp: int) -> None:
    """Raise ``ConfigError`` (a ValueError) unless ``heads`` splits evenly over ``cp`` ranks."""
    if heads % cp != 0:
        raise ConfigError(
            f"context_parallel.method 'ulysses' splits the {heads} attention heads over "
            f"context_parallel.size={cp} ranks, which does not divide them: choose a "
            f"context_parallel.size that divides {heads}, or context_parallel.method 'ring' "
            "(any head count)",
            key="context_parallel.size",
        )


def model_heads(model: nn.Module) -> int | None:
    """The model's query-head count, read where models keep it: a ``config`` / ``cfg``
    attribute (Hugging Face, the example GPT), else a submodule's own (``num_heads``, ...);
    None if it keeps none (then the first forward checks the tensors)."""
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None), *model.modules()):
        for attr in QUERY_HEAD_ATTRS:
            heads = getattr(holder, attr, None)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0:
                return heads
    return None


def check_model_heads(model: nn.Module, cp: int, tp: int, method: str) -> None:
    """In ``initialize``, before any work: the heads each tensor-parallel rank holds (H / tp)
    must split over the ``cp`` context ranks under Ulysses (``check_heads``'s rule)."""
    heads = model_heads(model) if method == "ulysses" and cp > 1 else None
    if heads is not None and heads % tp == 0:  # else tensor parallelism refuses the split
        check_heads(heads // tp, cp)


def ulysses_attention(
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

    q, k, v: this rank's (B, H, S/cp, D) shard in the balanced token order (token_order.py), H divisible
    by cp = len(ranks); returns (B, H, S/cp, D) in the same layout. The checks run before any
    communication, so every rank refuses the same input alike. ``scale`` defaults to
    1/sqrt(D). Differentiable with respect to q, k and v.
    """
    cp = len(ranks)
    check_shards(q, k, v, cp)
    check_heads(q.shape[1], cp)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if context_rank(ranks) != comm.get_rank(group):  # all-to-all orders chunks by group rank
        raise ValueError(f"ranks {list(ranks)} are not in the order of the context group")
    qh, kh, vh = (_to_heads(x, cp, group) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return _to_sequence(out, cp, group)
