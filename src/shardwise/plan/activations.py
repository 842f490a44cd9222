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
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from shardwise.config import ConfigError
from shardwise.parallel.activation.recompute import run_checkpointed
from shardwise.parallel.activation.selective import apply_activation_checkpointing
from shardwise.plan.shape import COLUMN_STYLES, ModelShape


@dataclass(frozen=True)
class Saved:
    """Bytes one micro-batch saves in one layer, by kind (see the module docstring)."""

    split: int = 0
    tp_input: int = 0
    replicated: int = 0

    def per_rank(self, tp: int, sequence_parallel: bool) -> float:
        rep = self.replicated / tp if sequence_parallel else self.replicated
        return self.split / tp + self.tp_input + rep

    @property
    def total(self) -> int:
        return self.split + self.tp_input + self.replicated


@dataclass(frozen=True)
class LayerActivations:
    plain: Saved
    checkpointed: Saved
    output_bytes: int  # what the layer hands the next one (a pipeline's message)
    output_ndim: int = 3
    tp_sites: tuple[tuple[str, int], ...] = ()  # see _hook_styles
    flops: int = 0  # forward FLOPs of one micro-batch, whole layer (torch's flop counter)


def _seen(t: torch.Tensor, ids: set[int]) -> bool:
    return id(t) in ids or (t._base is not None and id(t._base) in ids)


class _Tracker(TorchFunctionMode):
    """Tags tensors derived from a column layer's output as split, until a row layer."""

    def __init__(self) -> None:
        super().__init__()
        self.split: set[int] = set()
        self.inputs: set[int] = set()  # inputs of the column layer running now
        self.keep: list[torch.Tensor] = []  # tagged tensors stay alive: ids stay unique
        self.inside_split = 0  # >0 while a function of split tensors runs (saves inside it)
        self.events: list[tuple[str, int]] = []  # tensor-parallel collective sites, in order
        self.last_column_input: set[int] = set()

    def tag(self, out: Any, split: bool) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                (self.split.add if split else self.split.discard)(id(t))
                self.keep.append(t)

    def is_split(self, t: torch.Tensor) -> bool:
        return _seen(t, self.split)

    def follow(self, old: Any, new: Any) -> Any:
        """``new`` (a detached copy of ``old``) keeps ``old``'s tag."""
        if isinstance(old, torch.Tensor) and self.is_split(old):
            self.tag(new, True)
        return new

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        split = any(isinstance(a, torch.Tensor) and self.is_split(a) for a in tree_leaves(args))
        self.inside_split += split
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.inside_split -= split
        if split:
            self.tag(out, True)
        return out


def _bytes_of(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def _hook_styles(model: nn.Module, styles: dict[str, str], tr: _Tracker) -> list[Any]:
    """Forward hooks that tag split tensors and book the tensor-parallel collective sites:

    col_in    a column layer's input (one per input tensor: q, k, v share it)
    row_out   a row layer's output        emb_out  a vocabulary embedding's output
    rep_out   a colwise_rep layer's output (gathered)
    ce_rows   the targets of a vocabulary-parallel loss (two all-reduces of them)
    sp_in     a sequence-parallel module's input (the first one splits the sequence)
    """
    handles = []

    def column_pre(mod: nn.Module, args: tuple) -> None:
        ids = {id(t) for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
        if ids != tr.last_column_input:
            tr.events.append(("col_in", _bytes_of(args)))
        tr.inputs = tr.last_column_input = ids

    def column_post(rep: bool, mod: nn.Module, args: tuple, out: Any) -> None:
        tr.inputs = set()
        tr.tag(out, True)
        if rep:
            tr.events.append(("rep_out", _bytes_of(out)))

    def replicated_post(site: str, mod: nn.Module, args: tuple, out: Any) -> None:
        tr.tag(out, False)
        tr.events.append((site, _bytes_of(out)))

    for name, m in model.named_modules():
        style = styles.get(name)
        embedding = isinstance(m, nn.Embedding)
        if style in COLUMN_STYLES and not embedding:
            handles.append(m.register_forward_pre_hook(column_pre))
            post = functools.partial(column_post, style == "colwise_rep")
            handles.append(m.register_forward_hook(post))
        elif style == "rowwise" or (style == "vocab" and embedding):
            site = "row_out" if style == "rowwise" else "emb_out"
            handles.append(m.register_forward_hook(functools.partial(replicated_post, site)))
        elif style == "loss_parallel":
            rows = lambda mod, args: tr.events.append(("ce_rows", args[1].numel()))  # noqa: E731
            handles.append(m.register_forward_pre_hook(rows))
        elif style == "sequence_parallel":
            sp = lambda mod, args: tr.events.append(("sp_in", _bytes_of(args)))  # noqa: E731
            handles.append(m.register_forward_pre_hook(sp))
    return handles


def _cpu_attention_flops(q: Any, k: Any, *args: Any, **kw: Any) -> int:
    """The fused CPU attention: QK^T and PV, 2 FLOPs per multiply-add (torch counts the
    GPU kernels alike; this one it does not know)."""
    b, h, s, d = q  # torch's counter passes shapes
    return 4 * b * h * s * k[-2] * d


_FLOPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}


def _trace(
    fn: Callable[[Any], Any], x: Any, params: set[int], tr: _Tracker
) -> tuple[Saved, Any, int]:
    counts = {"split": 0, "tp_input": 0, "replicated": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) in params or id(base) in params:
            return t
        split = tr.is_split(t) or tr.inside_split > 0
        kind = "split" if split else "tp_input" if _seen(t, tr.inputs) else "replicated"
        counts[kind] += t.numel() * t.element_size()
        return t

    flops = FlopCounterMode(display=False, custom_mapping=_FLOPS)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tr, flops:
        out = fn(x)
    return Saved(**counts), out, flops.get_total_flops()


def _fresh_input(x: Any) -> Any:
    """The layer's input as a pipeline stage receives it: a leaf that requires grad."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_()
    return x


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
    twin = dict(zip(map(id, shape.module.modules()), model.modules(), strict=True))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        params = {id(p) for p in model.parameters()}
        tr = _Tracker()
        handles = _hook_styles(model, shape.styles, tr)
        ids = torch.zeros(micro_batch, seq, dtype=torch.long)
        if shape.pipeline:
            layers, x = _trace_chain(shape, twin, ids, params, tr)
            loss, tr.events = Saved(), []
            loss_fn = twin.get(id(shape.loss_fn), shape.loss_fn)
            if isinstance(loss_fn, nn.Module):
                run = functools.partial(_call_loss, loss_fn, ids)
                loss, _, _ = _trace(run, tr.follow(x, _fresh_input(x)), params, tr)
        else:
            layers, loss = [_trace_whole(model, ids, params, tr)], Saved()
            tr.events = []  # the loss ran inside the model: its sites are the layer's
        for h in handles:
            h.remove()
    return Trace(layers, loss, tuple(tr.events))


def _call_loss(loss_fn: nn.Module, ids: torch.Tensor, x: torch.Tensor) -> Any:
    return loss_fn(x, ids)


def _trace_chain(
    shape: ModelShape, twin: dict, ids: torch.Tensor, params: set[int], tr: _Tracker
) -> tuple[list[LayerActivations], Any]:
    """Each layer on the previous one's output; a checkpointed layer keeps its input only
    (one with no trainable parameter is never checkpointed, as PipelineModule decides)."""
    out, cache, x = [], {}, ids
    for fn, layer in zip(shape.callables, shape.layers, strict=True):
        fn = twin.get(id(fn), fn)
        key = (layer.kind, tuple(p.shape for p in layer.params), _signature(x))
        if key not in cache:
            tr.events, tr.last_column_input = [], set()
            plain, y, flops = _trace(fn, tr.follow(x, _fresh_input(x)), params, tr)
            sites = tuple(tr.events)
            ckpt = plain
            if any(p.trainable for p in layer.params) or layer.tied:
                ckpt_fn = functools.partial(_checkpointed, fn)
                ckpt, _, _ = _trace(ckpt_fn, tr.follow(x, _fresh_input(x)), params, tr)
            ndim = y.dim() if isinstance(y, torch.Tensor) else 0
            cache[key] = (LayerActivations(plain, ckpt, _bytes_of(y), ndim, sites, flops), y)
        out.append(cache[key][0])
        x = tr.follow(cache[key][1], cache[key][1].detach())
    return out, x


def _checkpointed(fn: Callable[[Any], Any], x: Any) -> Any:
    return run_checkpointed(fn, (x,), {})


def _trace_whole(
    model: nn.Module, ids: torch.Tensor, params: set[int], tr: _Tracker
) -> LayerActivations:
    """A model that is one layer: ``model(ids, ids)`` when its forward takes targets (its
    loss included), plainly and with ``checkpoint_layers: "all"`` (its block list)."""
    takes_targets = len(inspect.signature(model.forward).parameters) >= 2
    run = functools.partial(_call_model, takes_targets, ids)
    plain, y, flops = _trace(functools.partial(run, model), ids, params, tr)
    sites = tuple(tr.events)
    try:  # the model is the planner's own copy: checkpoint it in place, after the plain run
        apply_activation_checkpointing(model, "all")
        ckpt, _, _ = _trace(functools.partial(run, model), ids, params, tr)
    except ConfigError:  # no block list: checkpointing has nothing to choose
        ckpt = plain
    ndim = y.dim() if isinstance(y, torch.Tensor) else 0
    return LayerActivations(plain, ckpt, _bytes_of(y), ndim, sites, flops)


def _call_model(takes_targets: bool, ids: torch.Tensor, model: nn.Module, x: Any) -> Any:
    return model(x, ids) if takes_targets else model(x)


def _signature(x: Any) -> Any:
    return tuple((tuple(t.shape), t.dtype) for t in tree_leaves(x) if isinstance(t, torch.Tensor))
