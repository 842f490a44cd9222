"""Activation memory, traced: what one micro-batch's forward saves for backward, per layer.

Each distinct layer runs once on fake tensors (``FakeTensorMode``: shapes, dtypes and the
kernels the real device picks, e.g. the fused CPU attention, without any storage) under a
saved-tensor hook, as ``pipeline/meter.py`` counts a real run: every tensor autograd keeps,
once per save, parameters (and views of them) left out. A layer is traced twice, plainly and
under shardwise's activation checkpoint (then it keeps only its input).

Tensor parallelism changes what a rank saves, and the trace tells each saved tensor's kind
from the plan's styles, by following tensors from module to module:

    split       made from a column layer's output, up to the row layer that sums it
                (q, k, v, attention, the MLP's hidden, split logits): 1/t per rank
    tp_input    a column layer's own input: every rank keeps it whole
    replicated  the rest (norms, residuals, the block's input): whole, or 1/t of the sequence
                under sequence parallelism

Per rank: split / t + tp_input + replicated (/ t with sequence parallelism).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from shardwise.config import ConfigError
from shardwise.parallel.activation.recompute import run_checkpointed
from shardwise.parallel.activation.selective import apply_activation_checkpointing
from shardwise.parallel.moe.layer import MOELayer
from shardwise.plan.saved import Saved
from shardwise.plan.shape import ModelShape
from shardwise.plan.tracing import (
    Tracker,
    bytes_of,
    fresh_input,
    hook_styles,
    recompute_sites,
    trace,
)


@dataclass(frozen=True)
class LayerActivations:
    plain: Saved
    checkpointed: Saved
    output_bytes: int  # what the layer hands the next one (a pipeline's message)
    output_ndim: int = 3
    tp_sites: tuple[tuple[str, int], ...] = ()  # see hook_styles
    flops: int = 0  # forward FLOPs of one micro-batch, whole layer (torch's flop counter)
    recompute_sites: tuple[tuple[str, int], ...] = ()  # sites a checkpoint's recompute passes
    attention_flops: int = 0  # the part of ``flops`` in attention (context parallelism: x cp)
    ops: int = 0  # aten ops of its forward (a layer's fixed cost scales with them, timing.py)


@dataclass(frozen=True)
class Trace:
    """Per-layer saved bytes of one micro-batch, and what the loss saves (last stage)."""

    layers: list[LayerActivations]
    loss: Saved
    loss_sites: tuple[tuple[str, int], ...] = ()


def trace_layers(shape: ModelShape, micro_batch: int, seq: int, dtype: torch.dtype) -> Trace:
    """Saved bytes per layer of ``shape`` for one micro-batch of ``micro_batch`` sequences of
    ``seq`` token ids (layers of one class and parameter shapes are traced once)."""
    if shape.module is None:
        raise ValueError("trace_layers needs the model's module (read_model keeps it)")
    model = copy.deepcopy(shape.module).to(dtype)  # on meta: costs nothing
    for m in model.modules():
        if isinstance(m, MOELayer):  # unbound expert parallelism: the all-to-all is a copy
            m.bound = True  # here (no process group), its traffic is booked (a2a sites)
    twin = dict(zip(map(id, shape.module.modules()), model.modules(), strict=True))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        params = {id(p) for p in model.parameters()}
        tr = Tracker()
        handles = hook_styles(model, shape.styles, tr)
        ids = torch.zeros(micro_batch, seq, dtype=torch.long)
        if shape.pipeline:
            layers, x = _trace_chain(shape, twin, ids, params, tr)
            loss, tr.events = Saved(), []
            loss_fn = twin.get(id(shape.loss_fn), shape.loss_fn)
            if isinstance(loss_fn, nn.Module):
                run = functools.partial(_call_loss, loss_fn, ids)
                loss, _, _ = trace(run, tr.follow(x, fresh_input(x)), params, tr)
        else:
            layers, loss = [_trace_whole(model, ids, params, tr)], Saved()
            tr.events = []  # the loss ran inside the model: its sites are the layer's
        for h in handles:
            h.remove()
    return Trace(layers, loss, tuple(tr.events))


def _call_loss(loss_fn: nn.Module, ids: torch.Tensor, x: torch.Tensor) -> Any:
    return loss_fn(x, ids)


def _trace_chain(
    shape: ModelShape, twin: dict, ids: torch.Tensor, params: set[int], tr: Tracker
) -> tuple[list[LayerActivations], Any]:
    """Each layer on the previous one's output; a checkpointed layer keeps its input only
    (one with no trainable parameter is never checkpointed, as PipelineModule decides)."""
    out, cache, x = [], {}, ids
    for fn, layer in zip(shape.callables, shape.layers, strict=True):
        fn = _twin_of(fn, twin)
        key = (layer.kind, tuple(p.shape for p in layer.params), _signature(x))
        if key not in cache:
            tr.events, tr.last_column_input = [], set()
            plain, y, flops = trace(fn, tr.follow(x, fresh_input(x)), params, tr)
            sites, attention, ops = tuple(tr.events), tr.attention_flops, tr.ops
            ckpt, again = plain, ()
            if any(p.trainable for p in layer.params) or layer.tied:
                ckpt_fn = functools.partial(_checkpointed, fn)
                ckpt, z, _ = trace(ckpt_fn, tr.follow(x, fresh_input(x)), params, tr)
                again = recompute_sites(z, tr)
            ndim = y.dim() if isinstance(y, torch.Tensor) else 0
            acts = LayerActivations(
                plain, ckpt, bytes_of(y), ndim, sites, flops, again, attention, ops
            )
            cache[key] = (acts, y)
        out.append(cache[key][0])
        x = tr.follow(cache[key][1], cache[key][1].detach())
    return out, x


def _twin_of(fn: Any, twin: dict) -> Any:
    """``fn``'s copy in the traced model: the module itself, or a tied layer's
    ``partial(forward_fn, module)`` (PipelineModule's form) bound to the module's copy."""
    if isinstance(fn, functools.partial):
        args = tuple(twin.get(id(a), a) for a in fn.args)
        return functools.partial(fn.func, *args, **fn.keywords)
    return twin.get(id(fn), fn)


def _checkpointed(fn: Callable[[Any], Any], x: Any) -> Any:
    return run_checkpointed(fn, (x,), {})


def _trace_whole(
    model: nn.Module, ids: torch.Tensor, params: set[int], tr: Tracker
) -> LayerActivations:
    """A model that is one layer: ``model(ids, ids)`` when its forward takes targets (its
    loss included), plainly and with ``checkpoint_layers: "all"`` (its block list)."""
    takes_targets = len(inspect.signature(model.forward).parameters) >= 2
    run = functools.partial(_call_model, takes_targets, ids)
    plain, y, flops = trace(functools.partial(run, model), ids, params, tr)
    sites, ckpt, again, attention = tuple(tr.events), plain, (), tr.attention_flops
    ops = tr.ops
    try:  # the model is the planner's own copy: checkpoint it in place, after the plain run
        apply_activation_checkpointing(model, "all")
    except ConfigError:  # no block list: checkpointing has nothing to choose
        pass
    else:
        ckpt, z, _ = trace(functools.partial(run, model), ids, params, tr)
        again = recompute_sites(z, tr)
    ndim = y.dim() if isinstance(y, torch.Tensor) else 0
    return LayerActivations(plain, ckpt, bytes_of(y), ndim, sites, flops, again, attention, ops)


def _call_model(takes_targets: bool, ids: torch.Tensor, model: nn.Module, x: Any) -> Any:
    return model(x, ids) if takes_targets else model(x)


def _signature(x: Any) -> Any:
    return tuple((tuple(t.shape), t.dtype) for t in tree_leaves(x) if isinstance(t, torch.Tensor))
