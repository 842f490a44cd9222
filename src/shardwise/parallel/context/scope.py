"""What the engine binds for context parallelism, and ``shardwise.attention`` that reads it.

Model code stays parallelism-agnostic: it calls ``shardwise.attention(q, k, v, is_causal=...)``
where it would call ``scaled_dot_product_attention`` (same layout: batch, heads, sequence, head
dim) and takes its tokens' positions from ``shardwise.context_positions(local_len)``. The engine
makes its ``ContextParallel`` the active one while its forward and backward run (backward too:
activation checkpointing recomputes the forward there), so a free function finds the group of
the rank it runs on without a global process group; outside them, or with one context rank,
both are the plain single-process calls.

The loss of a context rank is the mean over its tokens; every context rank holds the same
number of tokens (token_order.py), so the average over the data x context ranks, which the gradient
reduction takes, is the mean over the whole batch, as in one process.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from shardwise.errors import EngineError
from shardwise.parallel.context import context_attention
from shardwise.parallel.context.token_order import sequence_positions, shard_sequence

if TYPE_CHECKING:  # annotations only
    from shardwise.config import Config
    from shardwise.topology import ProcessMesh

# The context of the engine whose forward or backward runs in this thread (None: no split).
_ACTIVE: contextvars.ContextVar[ContextParallel | None] = contextvars.ContextVar(
    "shardwise_context_parallel", default=None
)
# The same, as a plain global, for compiled code: dynamo cannot trace ContextVar.get, and
# reads a global under a guard (ID_MATCH: the same object every step, so no recompile).
_COMPILED_ACTIVE: list[ContextParallel | None] = [None]


@dataclass
class ContextParallel:
    """One rank's part in context parallelism: ``size`` ranks split every sequence (dim 1 of
    inputs and labels, dim 2 of q/k/v), this rank holding chunks ``rank`` and
    ``2 * size - 1 - rank`` of ``2 * size`` (token_order.py)."""

    size: int = 1
    rank: int = 0
    method: str = "ring"
    group: Any = None
    ranks: tuple[int, ...] = (0,)
    calls: int = 0  # attention calls under this context since the last forward began
    # A whole-sequence mapping batch -> (model inputs, per-token targets), before the cut;
    # the loss is then ``loss(outputs, targets, items)`` (integrations/hf_context.py)
    prepare: Callable[[Mapping], tuple[dict, torch.Tensor | None]] | None = None
    loss: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def from_mesh(cls, cfg: Config, mesh: ProcessMesh) -> ContextParallel:
        block = cfg.context_parallel
        if block.size == 1:
            return cls()
        ranks = tuple(mesh.axis_ranks("cp"))
        return cls(block.size, mesh.cp_rank, block.method, mesh.cp_group, ranks)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This context is the one ``shardwise.attention`` uses inside the block."""
        token = _ACTIVE.set(self if self.size > 1 else None)
        before, _COMPILED_ACTIVE[0] = _COMPILED_ACTIVE[0], _ACTIVE.get()
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            _COMPILED_ACTIVE[0] = before

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """``active()`` around a forward, refusing a model that never called
        ``shardwise.attention``: its attention would see only this rank's tokens."""
        self.calls = 0
        with self.active():
            yield
        if self.size > 1 and self.calls == 0:
            raise EngineError(
                f"context_parallel.size={self.size}: the model's forward made no "
                "shardwise.attention call, so its attention saw only this rank's "
                f"1/{self.size} of each sequence. Call shardwise.attention(q, k, v, "
                "is_causal=...) where the model calls scaled_dot_product_attention, or set "
                "context_parallel.size to 1"
            )

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``tensor`` along ``dim`` (the tensor itself without a split)."""
        if self.size == 1:
            return tensor
        return shard_sequence(tensor, dim, self.size, self.rank)

    def positions(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens of a ``seq_len``-token sequence."""
        return sequence_positions(seq_len, self.size, self.rank, device=device)

    def batch_loss(self, batch: Any) -> tuple[Any, Callable[[Any], torch.Tensor] | None]:
        """``(this rank's batch, its loss from the outputs)``: every tensor of two or more
        dimensions (nested in tuples, lists and mappings: token ids, labels, masks) cut along
        dim 1, the sequence, and None: the model's own loss. With ``prepare`` (a Hugging Face
        model) a mapping's labels become this rank's targets and the loss is computed from
        the logits."""
        if self.size == 1:
            return batch, None
        if self.prepare is None or not isinstance(batch, Mapping):
            return self._cut(batch), None
        inputs, targets = self.prepare(batch)
        if targets is None or self.loss is None:
            return self._cut(inputs), None
        items = (targets != -100).sum().float() / self.size  # -100: ignored, as Hugging Face
        mine, loss = self._cut(targets), self.loss
        return self._cut(inputs), lambda out: loss(out, mine, items)

    def _cut(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return self.shard(batch, 1) if batch.dim() >= 2 else batch
        if isinstance(batch, Mapping):
            return type(batch)({k: self._cut(v) for k, v in batch.items()})
        if isinstance(batch, (tuple, list)):
            return type(batch)(self._cut(v) for v in batch)
        return batch


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` over the whole sequence, whichever ranks hold it.

    (batch, heads, sequence, head dim) as torch's. Without context parallelism this is exactly
    torch's function; with it, ``query``/``key``/``value`` hold this rank's tokens and the
    result is this rank's rows of attention over every rank's keys (ring or Ulysses). With
    ``enable_gqa`` (grouped-query attention: fewer key/value heads, each serving
    heads / kv_heads query heads) the key/value heads are repeated before the split
    attention, as torch's function does implicitly."""
    ctx = _COMPILED_ACTIVE[0] if torch.compiler.is_compiling() else _ACTIVE.get()
    if ctx is None:
        gqa = {"enable_gqa": True} if enable_gqa else {}  # torch < 2.5 has no such argument
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal=is_causal, scale=scale, **gqa
        )
    if attn_mask is not None or dropout_p:
        raise EngineError(
            "shardwise.attention under context_parallel takes no attn_mask nor dropout_p "
            "(each rank holds part of the keys): use is_causal for causal masking, and "
            "dropout after attention, or set context_parallel.size to 1"
        )
    ctx.calls += 1
    if enable_gqa and key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]  # query head i uses key/value head i // groups
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return context_attention(
        query,
        key,
        value,
        is_causal=is_causal,
        method=ctx.method,
        group=ctx.group,
        ranks=ctx.ranks,
        scale=scale,
    )


def context_positions(local_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of this rank's ``local_len`` tokens (``arange`` without a split)."""
    # Read as shardwise.attention does: a model compiled whole traces this (ContextVar.get broke it)
    ctx = _COMPILED_ACTIVE[0] if torch.compiler.is_compiling() else _ACTIVE.get()
    if ctx is None:
        return torch.arange(local_len, device=device)
    return ctx.positions(local_len * ctx.size, device=device)
