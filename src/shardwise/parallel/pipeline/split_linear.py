"""The backward of a stage in two halves, B and W, for the zero-bubble schedules.

Every ``F.linear(x, weight, bias)`` that a stage's layers call with a weight that requires grad
(nn.Linear, the tensor-parallel linears, an MoE gate, ...) runs, while the stage's
``LinearSplitter`` is active, as ``_SplitLinear``: the same forward, and a backward in two
parts. With X (N, in) and dY (N, out) the input and the output gradient flattened over their
leading dimensions:

    B  input gradient, on the critical path:   dX = dY W          (N, out) @ (out, in)
    W  weight gradient, deferrable:            dW = dY^T X        (out, N) @ (N, in)
                                               db = sum_n dY[n]   (out,)

B is the stage's ordinary autograd backward run with a sink open (``deferring``): each linear
returns dX only and leaves (X, dY, weight, bias) in the sink. W (``weight_backward``) computes
dW and db from them and hands them to autograd (``torch.autograd.backward(weight, dW)``), so
they accumulate into ``.grad`` through the parameters' own accumulators and fire the hooks the
gradient strategies listen to. Without a sink the linear's backward does W at once (a nested
autograd call): the fused backward, ~6 % dearer than torch's own linear, so the executor
turns the splitter off for the micro-batches whose backward its program does not split.

Exactness: these are the products torch's own linear backward computes (addmm's and mm's
derivatives: dX = dY.mm(W); dW = dY^T.mm(X), or X^T.mm(dY) transposed when the weight is
stored transposed; db = dY summed over rows), on operands with the same layouts, so B + W gives
the fused backward's gradients bit for bit in fp32 (tests/test_pipe_split_backward.py). Layers
that are not linears (norms, embeddings, a tied head's matmul) do not split: their weight
gradients come in B, as in the fused backward.

Memory: between B and W each linear keeps X (autograd held it anyway until B) and dY (one
output gradient). Activation checkpointing recomputes a layer once, in B; W uses the X that
the recompute made.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


class Deferred(NamedTuple):
    """One linear's weight-gradient work, left by B for W."""

    x: torch.Tensor  # (.., in) the linear's input, detached
    dy: torch.Tensor  # (.., out) its output gradient, detached
    weight: torch.Tensor | None  # as the linear used it (the parameter or a view); None: frozen
    bias: torch.Tensor | None


_sink: list[Deferred] | None = None  # open during a B: where linears leave their W work


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])  # (.., k) -> (N, k)


def _weight_grad(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dW (out, in) = dY^T X, multiplied in the layout torch's mm backward uses for it: the
    linear multiplies by weight^T; when that is column-major (a weight stored (out, in)) torch
    computes (dY^T X), else (X^T dY)^T."""
    x_ni, dy_no = _flat(x), _flat(dy)
    if weight.stride(1) == 1 and weight.stride(0) == weight.shape[1]:
        return dy_no.t().mm(x_ni)
    return x_ni.t().mm(dy_no).t()


class _SplitLinear(torch.autograd.Function):
    """F.linear whose weight and bias reach autograd only through W.

    The function takes the weight and bias detached, with the tensors as the layer used them
    (``params``) on the side: B then has no edge into the parameters' accumulators, which
    autograd would otherwise call, and whose hooks (the gradient strategies') would fire,
    with no gradient. ``anchor`` (an empty tensor that requires grad) makes the output
    require grad when nothing else does (a first layer fed with data): B must still reach
    the linear to leave its W work."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        anchor: torch.Tensor | None,
        params: tuple,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params = params
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight_d = ctx.saved_tensors
        weight, bias = ctx.params
        dx = _flat(dy).mm(weight_d).view(x.shape) if ctx.needs_input_grad[0] else None
        work = Deferred(
            x.detach(),
            dy.detach(),
            weight if weight.requires_grad else None,
            bias if bias is not None and bias.requires_grad else None,
        )
        if _sink is not None:
            _sink.append(work)  # B: W does the rest
        else:
            weight_backward([work])  # fused: both now
        return dx, None, None, None, None


class _SplitMode(TorchFunctionMode):
    """Routes F.linear with a trainable weight through _SplitLinear (other calls untouched)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight, bias = _linear_args(*args, **kwargs)
            if weight.requires_grad and x.dim() >= 2:
                anchor = None if x.requires_grad else x.new_empty(0, requires_grad=True)
                detached = None if bias is None else bias.detach()
                return _SplitLinear.apply(x, weight.detach(), detached, anchor, (weight, bias))
        return func(*args, **kwargs)


def _linear_args(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return input, weight, bias


class LinearSplitter:
    """Makes a stage's linears splittable while ``active``: a hook on every module of the stage
    opens the routing (``_SplitMode``) around the outermost module call, so that forwards and
    the recomputes of checkpointed layers (which autograd runs inside B, where no mode set
    outside reaches) record the same _SplitLinear nodes."""

    def __init__(self, module: nn.Module) -> None:
        self.active = False
        self._open: list[tuple[nn.Module, _SplitMode | None]] = []  # module calls in progress
        self._handles = []
        for m in module.modules():
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._exit, always_call=True))

    def _enter(self, m: nn.Module, args: Any) -> None:
        if self.active:
            mode = None if self._open else _SplitMode()
            if mode is not None:
                mode.__enter__()
            self._open.append((m, mode))

    def _exit(self, m: nn.Module, args: Any, out: Any) -> None:
        if self._open and self._open[-1][0] is m:
            _, mode = self._open.pop()
            if mode is not None:
                mode.__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@contextmanager
def deferring(sink: list[Deferred]) -> Iterator[list[Deferred]]:
    """Inside: a backward through split linears is B; their W work goes to ``sink``."""
    global _sink
    outer, _sink = _sink, sink
    try:
        yield sink
    finally:
        _sink = outer


def weight_backward(work: list[Deferred]) -> None:
    """W: dW = dY^T X and db = sum_n dY for every deferred linear, accumulated into the
    parameters' ``.grad`` by autograd (their accumulation hooks fire)."""
    roots: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    with torch.no_grad():
        for d in work:
            if d.weight is not None:
                roots.append(d.weight)
                grads.append(_weight_grad(d.x, d.dy, d.weight))
            if d.bias is not None:
                roots.append(d.bias)
                grads.append(_flat(d.dy).sum(0))
    if roots:
        torch.autograd.backward(roots, grads)
