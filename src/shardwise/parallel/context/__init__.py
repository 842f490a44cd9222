"""Context parallelism: attention over a sequence split across the ``cp`` ranks of a group.

Every method takes and returns (batch, heads, S/cp, head_dim) shards in one load-balanced
token order (token_order.py: 2*cp chunks, rank r holds chunks r and 2*cp-1-r, so causal work is even).

* ``ring`` (ring.py): queries stay home; K/V blocks go round the ring (cp-1 hops each way in
  forward, their dK/dV partials travelling with them in backward), softmax combined online
  (log-sum-exp). Any head count; point-to-point traffic per rank of 2*(cp-1) blocks forward.
* ``ulysses`` (ulysses.py): all-to-alls swap the sequence split for a head split, local
  ``scaled_dot_product_attention`` on the full sequence, an all-to-all swaps back: 4
  all-to-alls of one block each per forward. Needs heads divisible by cp.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardwise import comm
from shardwise.parallel.context.ring import ring_attention
from shardwise.parallel.context.token_order import (
    check_sequence,
    chunk_ids,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from shardwise.parallel.context.ulysses import ulysses_attention

METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}

__all__ = [
    "METHODS",
    "check_sequence",
    "chunk_ids",
    "context_attention",
    "ring_attention",
    "sequence_positions",
    "shard_sequence",
    "ulysses_attention",
    "unshard_sequence",
]


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool,
    method: str,
    group: comm.Group,
    ranks: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's (B, H, S/cp, D) shards over the whole sequence, by ``method``
    ("ring" or "ulysses"); ``ranks`` are the global ranks of ``group`` in its rank order."""
    fn = METHODS.get(method)
    if fn is None:
        raise ValueError(
            f"context_parallel.method must be one of {sorted(METHODS)}, got {method!r}"
        )
    return fn(q, k, v, causal=is_causal, group=group, ranks=ranks, scale=scale)
