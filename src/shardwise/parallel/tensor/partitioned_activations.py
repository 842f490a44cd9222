"""Activation checkpointing with the kept inputs split over the tensor-parallel group.

DeepSpeed's ``partition_activations`` (Megatron-LM's "activation partitioning"). A checkpointed
block keeps only its inputs for backward; under tensor parallelism without sequence
parallelism those inputs (the residual stream, B x T x C) are the same on every TP rank, so N
ranks hold N copies. Here rank r keeps only chunk r of each input, flattened and padded to a
multiple of N: ceil(numel / N) elements instead of numel. Backward all-gathers the chunks
(one all-gather per input, (N - 1)/N of its bytes received per rank), rebuilds the input,
recomputes the block with the forward's random states and back-propagates through it.

Split axis: the flattened input, in N contiguous chunks (not a tensor dimension: any shape
works, and the chunk sizes differ by padding only).

Requirements, as in DeepSpeed: every tensor input is identical across the group (true for
the input of a Megatron block; false under sequence parallelism, where ``initialize`` refuses
the combination), and the block returns a tensor or a tuple of tensors. The recompute runs
inside backward (a reentrant autograd function, DeepSpeed's form): parameters' gradients are
accumulated there, so their hooks (data-parallel buckets) fire in the same order as without
partitioning. When no input requires grad the autograd function would hide the block's
parameters from backward: the block then runs under the plain checkpoint instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardwise.parallel.tensor import random as tp_random
from shardwise.parallel.tensor.comm import flat_chunk, unflat_gather

if TYPE_CHECKING:  # annotations only
    from torch.autograd.function import FunctionCtx
    from torch.distributed import ProcessGroup


def partitioned_checkpoint(
    function: Callable[..., Any], group: ProcessGroup | None, *args: Any, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)`` keeping 1/N of each tensor input for backward (module doc).

    ``group``: the tensor-parallel process group over which the inputs are replicated.
    Keyword arguments are passed through unsplit (kept whole, like non-tensor arguments).
    """
    if kwargs:
        inner = function
        function = lambda *a: inner(*a, **kwargs)  # noqa: E731
    return _PartitionedCheckpoint.apply(function, group, *args)


class _PartitionedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, function: Callable[..., Any], group: ProcessGroup | None, *args: Any
    ) -> Any:
        ctx.function, ctx.group = function, group
        ctx.rng = _rng_states(args)
        with torch.no_grad():
            outputs = function(*args)
        # Per argument: (shape, requires_grad) for a tensor, else the value itself.
        ctx.kinds = [
            (a.shape, a.requires_grad) if isinstance(a, torch.Tensor) else ("value", a)
            for a in args
        ]
        ctx.save_for_backward(*(flat_chunk(a, group) for a in args if isinstance(a, torch.Tensor)))
        return outputs

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple:
        chunks = iter(ctx.saved_tensors)
        inputs = []
        for kind in ctx.kinds:
            if kind[0] == "value":
                inputs.append(kind[1])
                continue
            shape, requires_grad = kind
            full = unflat_gather(next(chunks), shape, ctx.group)
            inputs.append(full.detach().requires_grad_(requires_grad))
        with _replayed(ctx.rng), torch.enable_grad():
            outputs = ctx.function(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=True)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(x.grad if isinstance(x, torch.Tensor) else None for x in inputs)
        return (None, None, *input_grads)


def needs_plain_checkpoint(args: tuple) -> bool:
    """True when no tensor input requires grad (see the module doc: use the plain path)."""
    return not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _rng_states(args: tuple) -> dict:
    """What the recompute must draw from: torch's CPU generator, the generator of each
    accelerator device among the inputs, and every tensor-parallel RNG tracker."""
    devices = sorted(
        {a.device for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"},
        key=str,
    )
    return {
        "cpu": torch.get_rng_state(),
        "devices": [(d, _device_module(d).get_rng_state(d)) for d in devices],
        "trackers": tp_random.all_tracker_states(),
    }


class _replayed:
    """Context: the forward's random states in, and back to the current ones after."""

    def __init__(self, states: dict) -> None:
        self.states = states

    def __enter__(self) -> None:
        self.now = {
            "cpu": torch.get_rng_state(),
            "devices": [(d, _device_module(d).get_rng_state(d)) for d, _ in self.states["devices"]],
            "trackers": tp_random.all_tracker_states(),
        }
        _set_rng_states(self.states)

    def __exit__(self, *exc: Any) -> None:
        _set_rng_states(self.now)


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    for device, state in states["devices"]:
        _device_module(device).set_rng_state(state, device)
    tp_random.set_tracker_states(states["trackers"])


def _device_module(device: torch.device) -> Any:
    return getattr(torch, device.type)  # torch.cuda, torch.xpu, ...: get/set_rng_state(device)
