"""Point-to-point between neighbouring stages: activations forward, their gradients back.

What crosses a stage boundary is a tensor or a tuple of tensors. The receiver must allocate
before it receives, so the first activation message of every batch (or every message, with
``dynamic_shape``) is preceded by its description, two small int64 messages:

    [length]  then  [partitioned, is_tuple, count, (dtype, requires_grad, ndim, *shape) per tensor]

Later micro-batches of the batch reuse it (the sender checks that they match). Gradients need
no description: the gradient of a tensor has its shape and dtype, and the sender of the
activation kept it. Gradients go back for the tensors that require grad on the sending side
(the description carries the flag), in order, zeros for one the next stage did not use: both
ends agree on what is sent without asking.

Sends are non-blocking (``isend``; the tensors are kept until ``wait_sends``), receives block:
with that, the schedules of schedule.py cannot deadlock (``schedule.simulate`` checks it).
A receive is a post (``irecv``) and a wait; ``post_activation`` / ``post_grads`` hand out the
posted receive (``Incoming``) so that an F&B step waits for it only when it needs it.
Ranks are global; messages use the default process group. Each message is tagged with the
virtual stage it goes to (activations 2w, gradients 2w + 1), so that with the interleaved
schedule, where two ranks exchange messages for several chunks, each lands where it belongs.

Partitioned messages (DeepSpeed's ``pipe_partitioned`` / ``grad_partitioned``, on by default):
with tensor parallelism (no sequence parallelism), what crosses a boundary is the same on the
N tensor-parallel ranks of a stage, and each of them would send it whole to its peer. Instead
TP rank t sends chunk t of the flattened tensor (ceil(numel / N) elements, ``flat_chunk``) and
the receiving stage's TP ranks all-gather the chunks (``unflat_gather``): the p2p bytes drop
N-fold, paid by one all-gather inside the TP group (on GPUs, the fast intra-node links).
Tensors with fewer than N elements go whole. The first message of a link checks, once, that
the TP ranks really hold the same tensors (a stage ending in a split layer would not); if not,
the link warns, naming the key, and sends whole tensors. The description carries the choice
for activations; for gradients one small flag message precedes the link's first gradients.

In the V placement the last stage runs virtual stages p-1 and p: its chunk 0 hands its output
to its own chunk 1, and chunk 1 the input gradient back, through a ``Loopback`` (no message):
the receiver gets a detached alias that is a leaf of its own graph, as a received tensor is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup

from shardwise import comm
from shardwise.parallel.tensor.comm import chunk_numel, flat_chunk, unflat_gather
from shardwise.wire_dtypes import WIRE_DTYPES

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup

_DTYPES = WIRE_DTYPES
_CODE = {d: i for i, d in enumerate(_DTYPES)}
logger = logging.getLogger("shardwise")


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


class Loopback:
    """The hand-over between two chunks of one rank (activations one way, gradients back)."""

    def __init__(self) -> None:
        self.acts: list[Any] = []
        self.grads: list[list[torch.Tensor]] = []


class StageLink:
    """The messages of virtual stage ``virtual`` (= the stage, without chunks) to and from its
    neighbours ``prev`` / ``next`` (global ranks, or None at the ends of the pipeline)."""

    def __init__(
        self,
        prev: int | None,
        next: int | None,
        dynamic_shape: bool = False,
        virtual: int = 0,
        act_group: ProcessGroup | None = None,
        grad_group: ProcessGroup | None = None,
        loop: tuple[Loopback | None, Loopback | None] = (None, None),
    ) -> None:
        """``act_group`` / ``grad_group``: the tensor-parallel group over which activations /
        gradients are sent partitioned (None: whole). ``loop``: the hand-over with the previous
        / next virtual stage when this rank runs it too (then ``prev`` / ``next`` is unused)."""
        self.prev, self.next = prev, next
        self.loop_prev, self.loop_next = loop
        self.act_group, self.grad_group = act_group, grad_group
        # Decided on the first message (None: not yet): partitioned, or whole after all.
        self._act_split: bool | None = None
        self._grad_split: bool | None = None  # the gradients this link sends
        self._grad_split_in: bool | None = None  # the gradients it receives
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
        if self.loop_next is not None:
            self.loop_next.acts.append(x)
            return
        if self._act_split is None:
            self._act_split = _decide(tensors, self.act_group, "pipe_partitioned", self.next)
        meta = [int(self._act_split), *_describe(x, tensors)]
        if self.dynamic_shape or self._sent_meta is None:
            self._isend(torch.tensor([len(meta)], dtype=torch.int64), self.next, self.act_out)
            self._isend(torch.tensor(meta, dtype=torch.int64), self.next, self.act_out)
            self._sent_meta = meta
        elif meta != self._sent_meta:
            raise PipeShapeError(
                f"the activation sent to rank {self.next} changed within a batch (description "
                f"{self._sent_meta} -> {meta}): pass dynamic_shape=True to PipelineModule"
            )
        group = self.act_group if self._act_split else None
        for t in tensors:
            self._isend(_outgoing(t, group), self.next, self.act_out)

    def recv_activation(self, requires_grad: bool) -> Any:
        """The previous stage's output; floating tensors require grad when training."""
        return self.post_activation(requires_grad, now=True).wait()

    def post_activation(self, requires_grad: bool, now: bool = False) -> Incoming:
        """``recv_activation`` posted now, waited for by ``wait()`` (the description, when one
        comes first, is received at once: the buffers need it); ``now``: a blocking receive
        (what the flight recorder then shows in flight while a stage waits)."""
        if self.loop_prev is not None:
            x = self.loop_prev.acts.pop(0)
            items = [_leaf(t, requires_grad) for t in as_tuple(x, "a stage's output")]
            return Incoming.ready(tuple(items) if isinstance(x, (tuple, list)) else items[0])
        if self.dynamic_shape or self._recv_meta is None:
            length = torch.zeros(1, dtype=torch.int64)
            comm.recv(length, self.prev, tag=self.act_in)
            meta = torch.zeros(int(length.item()), dtype=torch.int64)
            comm.recv(meta, self.prev, tag=self.act_in)
            self._recv_meta = meta.tolist()
        split, is_tuple, count, *rest = self._recv_meta
        group = self.act_group if split else None
        parts, at = [], 0
        for _ in range(count):
            code, grad, ndim = rest[at : at + 3]
            shape = rest[at + 3 : at + 3 + ndim]
            at += 3 + ndim
            take = self._post(shape, _DTYPES[code], self.prev, self.act_in, group, now)
            parts.append((take, grad))

        def finish() -> Any:
            tensors = []
            for t, grad in ((take(), grad) for take, grad in parts):
                if requires_grad and t.is_floating_point() and grad:
                    t.requires_grad_()
                tensors.append(t)
            return tuple(tensors) if is_tuple else tensors[0]

        return Incoming(finish)

    def send_grads(self, inputs: Any) -> None:
        """The gradients of the received tensors that require grad (zeros where none)."""
        grads = tuple(
            t.grad if t.grad is not None else torch.zeros_like(t)
            for t in as_tuple(inputs, "a received activation")
            if t.requires_grad
        )
        if self.loop_prev is not None:
            self.loop_prev.grads.append(list(grads))
            return
        if self._grad_split is None and self.grad_group is not None:
            self._grad_split = _decide(grads, self.grad_group, "grad_partitioned", self.prev)
            flag = torch.tensor([int(self._grad_split)], dtype=torch.int64)
            self._isend(flag, self.prev, self.grad_out)  # once: the receiver cannot tell
        group = self.grad_group if self._grad_split else None
        for grad in grads:
            self._isend(_outgoing(grad, group), self.prev, self.grad_out)

    def recv_grads(self, outputs: Any) -> list[torch.Tensor]:
        """Gradients for the tensors of ``outputs`` that require grad (as sent), in order."""
        return self.post_grads(outputs, now=True).wait()

    def post_grads(self, outputs: Any, now: bool = False) -> Incoming:
        """``recv_grads`` posted now, waited for by ``wait()`` (the link's first gradients are
        preceded by a flag, received at once); ``now`` as for ``post_activation``."""
        if self.loop_next is not None:
            return Incoming.ready(self.loop_next.grads.pop(0))
        if self._grad_split_in is None and self.grad_group is not None:
            flag = torch.zeros(1, dtype=torch.int64)
            comm.recv(flag, self.next, tag=self.grad_in)
            self._grad_split_in = bool(flag.item())
        group = self.grad_group if self._grad_split_in else None
        takes = [
            self._post(t.shape, t.dtype, self.next, self.grad_in, group, now)
            for t in as_tuple(outputs, "a stage's output")
            if t.requires_grad
        ]
        return Incoming(lambda: [take() for take in takes])

    def _post(
        self,
        shape: Any,
        dtype: torch.dtype,
        src: int,
        tag: int,
        group: ProcessGroup | None,
        now: bool,
    ) -> Callable[[], torch.Tensor]:
        """Post the receive of a tensor of ``shape`` from ``src`` (whole, or this rank's chunk
        then all-gathered; ``now``: received at once); the returned call waits for it and
        gives the tensor."""
        numel = torch.Size(shape).numel()
        split = _split(numel, group)
        buf = torch.empty(chunk_numel(numel, group) if split else shape, dtype=dtype)
        work = None if now else comm.irecv(buf, src, tag=tag)
        if now:
            comm.recv(buf, src, tag=tag)

        def take() -> torch.Tensor:
            if work is not None:
                work.wait()
            return unflat_gather(buf, shape, group) if split else buf

        return take

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


class Incoming:
    """Receives already posted; ``wait()`` waits for them and returns what they carry."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish = finish

    @classmethod
    def ready(cls, value: Any) -> Incoming:
        return cls(lambda: value)

    def wait(self) -> Any:
        return self._finish()


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """What the next chunk receives through a Loopback: ``t`` cut from its graph (an alias:
    a leaf that requires grad cannot be changed in place), requiring grad as sent."""
    return t.detach().requires_grad_(requires_grad and t.is_floating_point() and t.requires_grad)


def _split(numel: int, group: ProcessGroup | None) -> bool:
    """Whether a tensor of ``numel`` elements travels partitioned over ``group``."""
    return group is not None and numel >= comm.get_world_size(group) > 1


def _outgoing(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return flat_chunk(t, group) if _split(t.numel(), group) else t


def _decide(
    tensors: tuple[torch.Tensor, ...], group: ProcessGroup | None, key: str, peer: int | None
) -> bool:
    """Whether this link sends in 1/N chunks over ``group``: only if every rank of it holds
    the same ``tensors`` (a collective over ``group``, compared through a checksum per tensor:
    its sum and sum of squares in float64). Otherwise a warning, and whole tensors."""
    if group is None or comm.get_world_size(group) == 1:
        return False
    sums = torch.tensor(
        [v for t in tensors for v in (t.double().sum().item(), t.double().square().sum().item())],
        dtype=torch.float64,
    )
    seen = torch.empty(comm.get_world_size(group) * sums.numel(), dtype=torch.float64)
    comm.all_gather_into_tensor(seen, sums, group=group)
    same = torch.equal(seen.view(-1, sums.numel()), sums.expand(seen.numel() // sums.numel(), -1))
    if not same and comm.get_rank(group) == 0:
        logger.warning(
            "pipeline.%s: what this stage sends to rank %s differs across its tensor-parallel "
            "ranks (does its last layer leave it split?): sent whole, not in 1/N chunks",
            key,
            peer,
        )
    return same
