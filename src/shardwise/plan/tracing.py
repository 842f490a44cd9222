"""Tracing one forward on fake tensors: saved tensors by kind, collective sites, FLOPs.

``Tracker`` (a TorchFunctionMode) tags every tensor computed from a split one (a column
layer's output) until a row layer sums it; module hooks (``hook_styles``) book the places
where tensor parallelism communicates; ``trace`` runs a function under a saved-tensor hook
and torch's FLOP counter. activations.py turns this into per-layer numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from shardwise.parallel.moe.layer import MOELayer
from shardwise.parallel.tensor.styles import ROW
from shardwise.plan.saved import Saved
from shardwise.plan.shape import COLUMN_STYLES


def _seen(t: torch.Tensor, ids: set[int]) -> bool:
    return id(t) in ids or (t._base is not None and id(t._base) in ids)


class Tracker(TorchFunctionMode):
    """Tags tensors derived from a column layer's output as split, until a row layer."""

    def __init__(self) -> None:
        super().__init__()
        self.split: set[int] = set()
        self.inputs: set[int] = set()  # inputs of the column layer running now
        self.keep: list[torch.Tensor] = []  # tagged tensors stay alive: ids stay unique
        self.inside_split = 0  # >0 while a function of split tensors runs (saves inside it)
        self.events: list[tuple[str, int]] = []  # tensor-parallel collective sites, in order
        self.last_column_input: set[int] = set()
        self.loss_shape: tuple[int, int] | None = None  # (N, V) inside a loss_parallel module
        self.attention_flops = 0  # of the last trace: what context parallelism multiplies
        self.ops = 0  # of the last trace: aten ops its forward dispatched (OpCount)

    def tag(self, out: Any, split: bool) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                (self.split.add if split else self.split.discard)(id(t))
                self.keep.append(t)

    def enter_loss(self, mod: nn.Module, args: tuple) -> None:
        """A vocabulary-parallel loss starts: its N targets (two all-reduces of them)."""
        self.events.append(("ce_rows", args[1].numel()))
        self.loss_shape = (args[1].numel(), args[0].shape[-1])

    def leave_loss(self, mod: nn.Module, args: tuple, out: Any) -> None:
        self.loss_shape = None

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
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            self.events.append(("attn", bytes_of(args[0])))  # one query block (context: cp)
        split = any(isinstance(a, torch.Tensor) and self.is_split(a) for a in tree_leaves(args))
        self.inside_split += split
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.inside_split -= split
        if split:
            self.tag(out, True)
        return out


def bytes_of(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def hook_styles(model: nn.Module, styles: dict[str, str], tr: Tracker) -> list[Any]:
    """Forward hooks that tag split tensors and book the tensor-parallel collective sites:

    col_in    a column layer's input (one per input tensor: q, k, v share it)
    row_out   a row layer's output        emb_out  a vocabulary embedding's output
    rep_out   a colwise_rep layer's output (gathered)
    ce_rows   the targets of a vocabulary-parallel loss (two all-reduces of them)
    sp_in     a sequence-parallel module's input (the first one splits the sequence)
    a2a       a MoE layer's (E, C, M) dispatched slots (expert parallelism's all-to-alls)
    attn      a query block of scaled_dot_product_attention (booked by the Tracker itself)
    """
    handles = []
    for m in model.modules():
        if isinstance(m, MOELayer):
            a2a = lambda mod, args: tr.events.append(("a2a", bytes_of(args)))  # noqa: E731
            handles.append(m.experts.register_forward_pre_hook(a2a))

    def column_pre(mod: nn.Module, args: tuple) -> None:
        tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        # Alive to the end of the trace: a freed input's id could come back as the next
        # column layer's input and hide its all-gather (seen 92 vs 108 calls, by chance).
        tr.keep.extend(tensors)
        ids = {id(t) for t in tensors}
        if ids != tr.last_column_input:
            tr.events.append(("col_in", bytes_of(args)))
        tr.inputs = tr.last_column_input = ids

    def column_post(rep: bool, mod: nn.Module, args: tuple, out: Any) -> None:
        tr.inputs = set()
        tr.tag(out, True)
        if rep:
            tr.events.append(("rep_out", bytes_of(out)))

    def replicated_post(site: str, mod: nn.Module, args: tuple, out: Any) -> None:
        tr.tag(out, False)
        tr.events.append((site, bytes_of(out)))

    for name, m in model.named_modules():
        style = styles.get(name)
        embedding = isinstance(m, nn.Embedding)
        if style in COLUMN_STYLES and not embedding:
            handles.append(m.register_forward_pre_hook(column_pre))
            post = functools.partial(column_post, style == "colwise_rep")
            handles.append(m.register_forward_hook(post))
        elif style in ROW or (style == "vocab" and embedding):
            site = "row_out" if style in ROW else "emb_out"
            handles.append(m.register_forward_hook(functools.partial(replicated_post, site)))
        elif style == "loss_parallel":
            handles.append(m.register_forward_pre_hook(tr.enter_loss))
            handles.append(m.register_forward_hook(tr.leave_loss))
        elif style == "sequence_parallel":
            sp = lambda mod, args: tr.events.append(("sp_in", bytes_of(args)))  # noqa: E731
            handles.append(m.register_forward_pre_hook(sp))
    return handles


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: what a layer pays in fixed cost per call
    on a CPU (dispatch, allocation, a kernel's setup) whatever its size."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def _cpu_attention_flops(
    q: tuple[int, ...], k: tuple[int, ...], *args: object, **kw: object
) -> int:
    """The fused CPU attention: QK^T and PV, 2 FLOPs per multiply-add (torch counts the
    GPU kernels alike; this one it does not know)."""
    b, h, s, d = q  # torch's counter passes shapes
    return 4 * b * h * s * k[-2] * d


_FLOPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}


def trace(
    fn: Callable[[Any], Any], x: Any, params: set[int], tr: Tracker
) -> tuple[Saved, Any, int]:
    """``fn(x)`` under the saved-tensor hook: (saved bytes by kind, output, forward FLOPs)."""
    counts = {"split": 0, "tp_input": 0, "replicated": 0, "vocab_loss": 0}
    loss_shape: list[tuple[int, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) in params or id(base) in params:
            return t
        if tr.loss_shape is not None:
            counts["vocab_loss"] += t.numel() * t.element_size()
            loss_shape[:] = [tr.loss_shape]
        split = tr.is_split(t) or tr.inside_split > 0
        kind = "split" if split else "tp_input" if _seen(t, tr.inputs) else "replicated"
        counts[kind] += t.numel() * t.element_size()
        return t

    flops = FlopCounterMode(display=False, custom_mapping=_FLOPS)
    ops = OpCount()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tr, flops, ops:
        out = fn(x)
    tr.ops = ops.n
    rows, vocab = loss_shape[0] if loss_shape else (0, 0)
    counts_by_op = flops.get_flop_counts().get("Global", {})
    tr.attention_flops = sum(n for op, n in counts_by_op.items() if "attention" in str(op))
    return Saved(**counts, vocab_rows=rows, vocab=vocab), out, flops.get_total_flops()


def recompute_sites(out: Any, tr: Tracker) -> tuple[tuple[str, int], ...]:
    """Run backward from ``out`` (a checkpointed forward's result) on fake tensors and return
    the collective sites its recompute passes: torch's checkpoint stops recomputing at the
    last tensor the backward needs, so a block's final row layer is often not run again."""
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return ()
    tr.events, tr.last_column_input = [], set()
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
    sites, tr.events = tuple(tr.events), []
    return sites


def fresh_input(x: Any) -> Any:
    """The layer's input as a pipeline stage receives it: a leaf that requires grad."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_()
    return x
