"""Flat buffers: many parameters laid end to end in one 1-D tensor, cut into equal shards.

A ``FlatLayout`` places parameters p_0, p_1, ... at offsets o_0 = 0, o_{i+1} = o_i + numel(p_i)
and pads the total to a multiple of ``parts`` so that the buffer splits into ``parts`` equal
shards; shard r is [r*S, (r+1)*S) with S = padded / parts. Padding is zero in every buffer
(parameters, gradients, optimizer states) and never reaches a result.

Buckets are the unit of communication: a collective moves one bucket's buffer. Parameters are
bucketed in reverse registration order (about the order backward produces gradients), at most
``max_elements`` per bucket (one larger parameter goes alone), one dtype/device/group each.

The layout keeps each parameter's shape: a ZeRO-3 parameter is released between uses (its data
empty), so its own shape says nothing then. DP, ZeRO-1/2 buckets and ZeRO-3 units all use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class FlatLayout:
    """Where each parameter lives inside a flat buffer of ``padded`` elements."""

    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    padded: int
    parts: int
    shapes: list[torch.Size]

    @classmethod
    def of(
        cls,
        params: Sequence[torch.nn.Parameter],
        parts: int = 1,
        shapes: Sequence[torch.Size] | None = None,
    ) -> FlatLayout:
        """``shapes``: the parameters' shapes when their data does not show them (released)."""
        shapes = [p.shape for p in params] if shapes is None else list(shapes)
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += math.prod(shape)
        padded = ceil_div(total, parts) * parts
        return cls(list(params), offsets, total, padded, parts, shapes)

    @property
    def shard_numel(self) -> int:
        return self.padded // self.parts

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def new_buffer(
        self, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        return torch.zeros(self.padded, dtype=dtype or self.dtype, device=device or self.device)

    def view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's slice of ``buffer``, shaped like the parameter."""
        n = math.prod(self.shapes[i])
        return buffer[self.offsets[i] : self.offsets[i] + n].view(self.shapes[i])

    def shard(self, buffer: torch.Tensor, r: int) -> torch.Tensor:
        s = self.shard_numel
        return buffer[r * s : (r + 1) * s]

    def gather_into(self, buffer: torch.Tensor, source: str = "data") -> None:
        """Copy every parameter's ``data`` (or ``grad``; missing grads as zero) into ``buffer``."""
        for i, p in enumerate(self.params):
            t = p.data if source == "data" else p.grad
            if t is None:
                self.view(buffer, i).zero_()
            else:
                self.view(buffer, i).copy_(t)

    def overlaps(self, r: int) -> list[tuple[int, int, int, int]]:
        """The pieces of parameters inside shard r: (param index, start in param, start in
        shard, length) — what a checkpoint or a consolidation needs to map shard to tensor."""
        lo, hi = r * self.shard_numel, (r + 1) * self.shard_numel
        out = []
        for i, shape in enumerate(self.shapes):
            a, b = self.offsets[i], self.offsets[i] + math.prod(shape)
            start, end = max(a, lo), min(b, hi)
            if start < end:
                out.append((i, start - a, start - lo, end - start))
        return out


def ceil_div(a: int, b: int) -> int:
    """The number of size-``b`` parts that hold ``a`` elements (shard sizes round up)."""
    return -(-a // b)


def plan_buckets(
    params: Sequence[torch.nn.Parameter],
    max_elements: int,
    parts: int = 1,
    key: Callable[[torch.nn.Parameter], Hashable] | None = None,
) -> list[FlatLayout]:
    """Group trainable parameters (reverse order) into layouts of at most ``max_elements``.

    ``key`` separates parameters that must not share a buffer (dtype, device and, for sharded
    optimizers, the optimizer parameter group).
    """
    key = key or (lambda p: (p.dtype, p.device))
    layouts: list[FlatLayout] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in reversed([p for p in params if p.requires_grad]):
        if current and (size + p.numel() > max_elements or key(p) != key(current[0])):
            layouts.append(FlatLayout.of(current, parts))
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        layouts.append(FlatLayout.of(current, parts))
    return layouts
