"""Point-to-point between neighbouring stages: activations forward, their gradients back.

What crosses a stage boundary is a tensor or a tuple of tensors. The receiver must allocate
before it receives, so the first activation message of every batch (or every message, with
``dynamic_shape``) is preceded by its description, two small int64 messages:

    [length]  then  [is_tuple, count, (dtype code, requires_grad, ndim, *shape) per tensor]

Later micro-batches of the batch reuse it (the sender checks that they match). Gradients need
no description: the gradient of a tensor has its shape and dtype, and the sender of the
activation kept it. Gradients go back for the tensors that require grad on the sending side
(the description carries the flag), in order, zeros for one the next stage did not use: both
ends agree on what is sent without asking.

Sends are non-blocking (``isend``; the tensors are kept until ``wait_sends``), receives block:
with that, the schedules of schedule.py cannot deadlock (``schedule.simulate`` checks it).
Ranks are global; messages use the default process group. Each message is tagged with the
virtual stage it goes to (activations 2w, gradients 2w + 1), so that with the interleaved
schedule, where two ranks exchange messages for several chunks, each lands where it belongs.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise import comm

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


class PipeShapeError(RuntimeError):
    """An activation whose shape changed within a batch without ``dynamic_shape=True``."""


def as_tuple(x: Any, what: str) -> tuple[torch.Tensor, ...]:
    """``x`` as a tuple of tensors, or a clear error naming where it came from."""
    items = x if isinstance(x, (tuple, list)) else (x,)
    for t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{what} must be a tensor or a tuple of tensors to cross a pipeline stage "
                f"boundary, got {type(t).__name__}"
            )
        if t.dtype not in _CODE:
            raise TypeError(f"{what}: dtype {t.dtype} cannot be sent between stages")
    return tuple(items)


def _describe(x: Any, tensors: tuple[torch.Tensor, ...]) -> list[int]:
    meta = [int(isinstance(x, (tuple, list))), len(tensors)]
    for t in tensors:
        meta += [_CODE[t.dtype], int(t.requires_grad), t.dim(), *t.shape]
    return meta


class StageLink:
    """The messages of virtual stage ``virtual`` (= the stage, without chunks) to and from its
    neighbours ``prev`` / ``next`` (global ranks, or None at the ends of the pipeline)."""

    def __init__(
        self, prev: int | None, next: int | None, dynamic_shape: bool = False, virtual: int = 0
    ) -> None:
        self.prev, self.next = prev, next
        self.act_in, self.act_out = 2 * virtual, 2 * (virtual + 1)
        self.grad_in, self.grad_out = 2 * virtual + 1, 2 * (virtual - 1) + 1
        self.dynamic_shape = dynamic_shape
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._sent_meta: list[int] | None = None
        self._recv_meta: list[int] | None = None

    def new_batch(self) -> None:
        """Describe the activations again at the next send/receive (shapes may change between
        batches, not within one)."""
        self._sent_meta = self._recv_meta = None

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.detach().contiguous()
        self._pending.append((comm.isend(t, dst, tag=tag), t))  # keep it alive until sent

    def send_activation(self, x: Any) -> None:
        tensors = as_tuple(x, "a stage's output")
        meta = _describe(x, tensors)
        if self.dynamic_shape or self._sent_meta is None:
            self._isend(torch.tensor([len(meta)], dtype=torch.int64), self.next, self.act_out)
            self._isend(torch.tensor(meta, dtype=torch.int64), self.next, self.act_out)
            self._sent_meta = meta
        elif meta != self._sent_meta:
            raise PipeShapeError(
                f"the activation sent to rank {self.next} changed within a batch (description "
                f"{self._sent_meta} -> {meta}): pass dynamic_shape=True to PipelineModule"
            )
        for t in tensors:
            self._isend(t, self.next, self.act_out)

    def recv_activation(self, requires_grad: bool) -> Any:
        """The previous stage's output; floating tensors require grad when training."""
        if self.dynamic_shape or self._recv_meta is None:
            length = torch.zeros(1, dtype=torch.int64)
            comm.recv(length, self.prev, tag=self.act_in)
            meta = torch.zeros(int(length.item()), dtype=torch.int64)
            comm.recv(meta, self.prev, tag=self.act_in)
            self._recv_meta = meta.tolist()
        is_tuple, count, *rest = self._recv_meta
        tensors, at = [], 0
        for _ in range(count):
            code, grad, ndim = rest[at : at + 3]
            shape = rest[at + 3 : at + 3 + ndim]
            at += 3 + ndim
            t = torch.empty(shape, dtype=_DTYPES[code])
            comm.recv(t, self.prev, tag=self.act_in)
            if requires_grad and t.is_floating_point() and grad:
                t.requires_grad_()
            tensors.append(t)
        return tuple(tensors) if is_tuple else tensors[0]

    def send_grads(self, inputs: Any) -> None:
        """The gradients of the received tensors that require grad (zeros where none)."""
        for t in as_tuple(inputs, "a received activation"):
            if t.requires_grad:
                grad = t.grad if t.grad is not None else torch.zeros_like(t)
                self._isend(grad, self.prev, self.grad_out)

    def recv_grads(self, outputs: Any) -> list[torch.Tensor]:
        """Gradients for the tensors of ``outputs`` that require grad (as sent), in order."""
        grads = []
        for t in as_tuple(outputs, "a stage's output"):
            if t.requires_grad:
                g = torch.empty_like(t, memory_format=torch.contiguous_format)
                comm.recv(g, self.next, tag=self.grad_in)
                grads.append(g)
        return grads

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
