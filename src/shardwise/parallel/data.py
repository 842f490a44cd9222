"""Data parallelism: gradients all-reduced in buckets while backward is still running.

Every data-parallel rank holds the whole model and computes gradients on its own micro-batch.
With the loss of each rank a mean over its b samples, the gradient of the mean over the global
batch of N*b samples is

    g = (1/N) * sum_r g_r

so each bucket is summed over the data-parallel group and divided by N.

Buckets: parameters are taken in reverse registration order (roughly the order backward
produces their gradients) and packed into flat buffers of about ``bucket_bytes``. Each
parameter's ``.grad`` is a view into its bucket buffer, so autograd accumulates straight into
the buffer and nothing is copied before sending. A per-parameter hook fires once the gradient
is fully accumulated; when a bucket's last gradient arrives, its all-reduce is launched
asynchronously and the next layers' backward runs while it travels. ``finish()`` waits for
all buckets, divides by N and launches any bucket whose parameters got no gradient (unused in
this step), so every rank issues the same collectives in the same order.

On accumulation micro-steps that are not the boundary the hooks do nothing: gradients keep
accumulating locally and only the last micro-step communicates.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise import clip, comm


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    pending: int = 0
    work: Any = None
    ready: set = field(default_factory=set)


class DataParallelReducer:
    """Bucketed, overlapped gradient all-reduce over one data-parallel group."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        group: Any = None,
        bucket_bytes: int = 25 * 2**20,
    ) -> None:
        self.group = group
        self.world = comm.get_world_size(group)
        self.sync = True
        self._hooks: list[Any] = []
        trainable = [p for p in params if p.requires_grad]
        # Reverse registration order approximates the order backward produces gradients.
        self.buckets = _make_buckets(list(reversed(trainable)), bucket_bytes)
        self._where = {id(p): b for b in self.buckets for p in b.params}
        self._offset = {
            id(p): off for b in self.buckets for p, off in zip(b.params, b.offsets, strict=True)
        }
        if self.world > 1:
            for p in trainable:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._bind_grads()

    # -- gradients as views of the buckets
    def _bind_grads(self) -> None:
        for b in self.buckets:
            for p, off in zip(b.params, b.offsets, strict=True):
                view = b.buffer[off : off + p.numel()].view_as(p)
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view

    def _ensure_in_bucket(self, p: torch.nn.Parameter, b: _Bucket) -> None:
        """Re-bind ``p.grad`` into the bucket if the user replaced it (e.g. zero_grad())."""
        off = self._offset[id(p)]
        view = b.buffer[off : off + p.numel()].view_as(p)
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    # Every rank ends the step with the same full gradient: the norm needs no communication.
    norm_group = clip.LOCAL

    def owned_grads(self) -> list[torch.Tensor]:
        """The gradients whose squares make up the global norm (all of them, once)."""
        return [p.grad for b in self.buckets for p in b.params if p.grad is not None]

    def zero_grad(self) -> None:
        """Zero every bucket in place (gradients stay bound to their buffers)."""
        for b in self.buckets:
            b.buffer.zero_()
        self._bind_grads()

    # -- the backward pass
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.sync:
            return
        b = self._where[id(p)]
        if b.work is not None or id(p) in b.ready:
            return
        b.ready.add(id(p))
        if len(b.ready) == len(b.params):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        for p in b.params:
            self._ensure_in_bucket(p, b)
        b.work = comm.all_reduce(b.buffer, group=self.group, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket (launching the ones with unused parameters) and average."""
        if self.world == 1:
            self._bind_grads()
            return
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        for b in self.buckets:
            b.work.wait()
            b.buffer.div_(self.world)
            b.work = None
            b.ready.clear()

    def all_reduce_now(self) -> None:
        """Reduce every bucket at once (gradients produced outside the hooks)."""
        for b in self.buckets:
            b.ready = {id(p) for p in b.params}
            if b.work is None:
                self._launch(b)
        self.finish()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
    """Pack parameters into buckets of at most ``bucket_bytes`` (a bigger tensor goes alone).

    A bucket holds one dtype and one device, so a mixed model gets one bucket per kind.
    """
    buckets: list[_Bucket] = []
    current: list[torch.nn.Parameter] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            buckets.append(_new_bucket(current))
        current, size = [], 0

    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (
            size + nbytes > bucket_bytes
            or p.dtype != current[0].dtype
            or p.device != current[0].device
        ):
            close()
        current.append(p)
        size += nbytes
    close()
    return buckets


def _new_bucket(params: list[torch.nn.Parameter]) -> _Bucket:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
    return _Bucket(params=params, offsets=offsets, buffer=buffer)


def broadcast_parameters(module: torch.nn.Module, src: int, group: Any = None) -> None:
    """Make every rank of ``group`` start from global rank ``src``'s weights and buffers."""
    if comm.get_world_size(group) == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            comm.broadcast(t.data, src=src, group=group)
