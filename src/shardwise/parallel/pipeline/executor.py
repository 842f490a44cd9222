"""The executor: runs one stage's instruction list (schedule.py) for one global batch.

It is a dispatcher and nothing more: each instruction maps to one handler. Per micro-batch i
the stage keeps, between its forward and its backward, the input it received (to send its
gradient back), the output it produced (the root of the autograd graph that stores the
activations) and its layers' auxiliary loss terms (aux_loss.py, a second root of the backward,
with the gradient S / m the loss gets); all are dropped by the backward, so the live micro-batches are exactly the
schedule's "in flight" ones. With the interleaved schedule a rank runs several chunks (virtual
stages); everything is then keyed by (micro-batch, chunk) and each chunk has its own link.

Gradients and the loss: the last stage backpropagates ``loss_i / m * S`` (m micro-batches, S the
fp16 loss scale, 1 otherwise), so that the accumulated gradient is that of the batch mean, as
``engine.backward`` does. Each backward is wrapped by the gradient strategy's
``before_backward(sync)`` / ``after_backward(sync)`` with ``sync`` true for the stage's last
backward only: plain data parallelism and ZeRO-1 then reduce once per batch, overlapped with
that backward, and ZeRO-2 reduce-scatters every micro-batch as it must. REDUCE_GRADS waits for
the reduction; REDUCE_TIED and OPTIMIZER_STEP call back into the runner.

Zero-bubble schedules split a backward into BACKWARD_INPUT (B) and BACKWARD_WEIGHT (W)
(split_linear.py): while such a program runs, the stage's linears record a splittable backward;
B is the ordinary backward with the linears' weight work left aside per (micro-batch, chunk),
W does it. Each B and each W is wrapped by the strategy's before/after_backward like a
backward, ``sync`` on the stage's last instruction that writes gradients (the last W, or the
last B when a chunk has nothing to defer). A stage whose first split batch left nothing for W
(no linear) has ``splits`` False, and the runner gives it fused programs from then on.

A FORWARD_BACKWARD (DualPipeV's F&B) runs a forward and another unit's full backward with
their messages: both receives posted first, each waited for when its unit needs it, so that
the communication of one overlaps the compute of the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.monitor.timers import PHASES
from shardwise.parallel.pipeline.aux_loss import chunk_aux_loss
from shardwise.parallel.pipeline.instructions import GRADIENT_OPS, Instruction, Op, units
from shardwise.parallel.pipeline.meter import ActivationMeter
from shardwise.parallel.pipeline.p2p import StageLink, as_tuple
from shardwise.parallel.pipeline.split_linear import (
    Deferred,
    LinearSplitter,
    deferring,
    weight_backward,
)

if TYPE_CHECKING:  # annotations only
    from shardwise.parallel.strategy_contract import GradientStrategy

_UNTIMED = contextlib.nullcontext()


@dataclass
class _Batch:
    """What one run keeps per micro-batch."""

    data_iter: Iterator | None
    train: bool
    scale: float
    micro_batches: int
    last_backward: Instruction | None  # the last instruction that writes gradients: sync
    inputs: dict[tuple[int, int], Any] = field(default_factory=dict)  # (micro-batch, chunk) ->
    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    labels: dict[int, Any] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    to_send: dict[tuple[int, int], Any] = field(default_factory=dict)
    deferred: dict[tuple[int, int], list[Deferred]] = field(default_factory=dict)  # B -> W
    held: dict[tuple[int, int], list[Any]] = field(default_factory=dict)  # the meter's books
    deferred_any: bool = False  # some B left W work
    losses: list[torch.Tensor] = field(default_factory=list)
    aux: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # forward -> backward
    aux_total: torch.Tensor | None = None  # this stage's auxiliary terms over the batch
    logits: list[Any] = field(default_factory=list)
    keep_logits: bool = False
    # In a split program, the (micro-batch, chunk)s whose backward is full (BACKWARD, F&B):
    # they run plain linears, not the splitter's (its fused backward is a nested autograd
    # call per linear, ~6 % more CPU on a GPT block than torch's own linear backward).
    fused: set[tuple[int, int]] | None = None


class StageExecutor:
    """Executes instruction lists on one stage; see the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        links: list[StageLink],
        first: bool,
        last: bool,
        loss_fn: Callable | None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        """``links[c]``: chunk c's link; ``first`` / ``last``: this rank runs the first / last
        stage (the first stage's chunk 0 reads the inputs, the last stage's last chunk the
        labels and computes the loss)."""
        self.module = module
        self.links = links
        self.chunks = len(links)
        self.first, self.last = first, last
        self.loss_fn = loss_fn
        self.compute_dtype = compute_dtype
        self.meter: ActivationMeter | None = None
        # The engine's monitor times each instruction under DeepSpeed's names (wall_clock_
        # breakdown) and profiles a forward (flops_profiler): ``section(name)`` is a context.
        self.section: Callable[[str], Any] | None = None
        self.live = 0  # micro-batches between forward and backward
        self.peak_live = 0
        self.splitter: LinearSplitter | None = None  # made by the first split program
        # Whether this stage's B's left any W work (None: no split program ran yet); False:
        # its layers cannot split, and the runner writes its programs with fused backwards.
        self.splits: bool | None = None
        self._handlers = {
            Op.LOAD: self._load,
            Op.RECV_ACT: self._recv_act,
            Op.FORWARD: self._forward,
            Op.SEND_ACT: self._send_act,
            Op.RECV_GRAD: self._recv_grad,
            Op.BACKWARD: self._backward,
            Op.BACKWARD_INPUT: self._backward_input,
            Op.BACKWARD_WEIGHT: self._backward_weight,
            Op.SEND_GRAD: self._send_grad,
            Op.FORWARD_BACKWARD: self._forward_backward,
        }

    def run(
        self,
        program: list[Instruction],
        data_iter: Iterator | None,
        *,
        train: bool,
        micro_batches: int,
        strategy: GradientStrategy = None,
        scale: float = 1.0,
        actions: dict[Op, Callable[[], None]] | None = None,
        keep_logits: bool = False,
    ) -> _Batch:
        """Execute ``program``; returns the run's record (losses on the last stage)."""
        backwards = [u for ins in program for u in units(ins) if u.op in GRADIENT_OPS]
        state = _Batch(data_iter, train, scale, micro_batches, backwards[-1] if backwards else None)
        state.keep_logits = keep_logits
        self.strategy = strategy
        for link in self.links:
            link.new_batch()
        split = train and any(ins.op is Op.BACKWARD_WEIGHT for ins in program)
        if split and self.splitter is None:
            self.splitter = LinearSplitter(self.module)
        if self.splitter is not None:
            self.splitter.active = split
        if split:
            full = (u for ins in program for u in units(ins) if u.op is Op.BACKWARD)
            state.fused = {(u.mb, u.chunk) for u in full}
        try:
            self._dispatch(program, state, actions)
        finally:
            if self.splitter is not None:
                self.splitter.active = False
        if split:
            self.splits = bool(self.splits) or state.deferred_any
        return state

    def _dispatch(self, program: list[Instruction], state: _Batch, actions: dict | None) -> None:
        train, strategy = state.train, self.strategy
        for ins in program:
            name = PHASES.get(ins.op.name) if train and self.section is not None else None
            with self.section(name) if name else _UNTIMED:
                handler = self._handlers.get(ins.op)
                if handler is not None:
                    handler(state, ins)
                elif ins.op is Op.REDUCE_GRADS:
                    strategy.after_backward(True)
                else:
                    (actions or {})[ins.op]()  # OPTIMIZER_STEP: the engine times its step

    def wait_sends(self) -> None:
        for link in self.links:
            link.wait_sends()

    def _is_first(self, chunk: int) -> bool:
        return self.first and chunk == 0

    def _is_last(self, chunk: int) -> bool:
        return self.last and chunk == self.chunks - 1

    # ------------------------------------------------------------------ handlers
    def _load(self, st: _Batch, ins: Instruction) -> None:
        if st.data_iter is None:
            raise ValueError(
                "the first and last pipeline stages read the batches: pass "
                "engine.train_batch(data_iter) (or training_data to initialize) on those ranks"
            )
        batch = next(st.data_iter)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                "with a pipeline every batch must be an (inputs, labels) pair, got "
                f"{type(batch).__name__}{'' if not isinstance(batch, (tuple, list)) else len(batch)}"
            )
        inputs, labels = batch
        if self._is_first(ins.chunk):
            st.inputs[(ins.mb, 0)] = _cast(inputs, self.compute_dtype)
        if self.last:  # the last chunk's LOAD; in a V, chunk 0's (one batch per micro-batch)
            st.labels[ins.mb] = labels

    def _recv_act(self, st: _Batch, ins: Instruction) -> None:
        link = self.links[ins.chunk]
        st.inputs[(ins.mb, ins.chunk)] = link.recv_activation(requires_grad=st.train)

    def _forward(self, st: _Batch, ins: Instruction) -> None:
        key, first, last = (ins.mb, ins.chunk), self._is_first(ins.chunk), self._is_last(ins.chunk)
        x = st.inputs[key] if st.train and not first else st.inputs.pop(key)
        chunk = ins.chunk if self.chunks > 1 else None
        if st.fused is not None:  # a split program: split linears only where B and W part
            self.splitter.active = key not in st.fused
        if self.meter is not None and st.train:
            with self.meter.hooks():
                out = self.module(x, chunk=chunk)
        else:
            out = self.module(x, chunk=chunk)
        if last:
            if st.keep_logits:
                st.logits.append(out.detach() if isinstance(out, torch.Tensor) else out)
            out = self._loss(out, st.labels.pop(ins.mb))
            st.losses.append(out.detach().float())
        # The layers' own loss terms (aux_loss.py), taken after the loss as one process adds
        # them to it: on the last chunk they join the loss, elsewhere they are a second root.
        aux = chunk_aux_loss(self.module, chunk)
        if aux is not None:
            st.aux_total = aux.detach().float() + (0.0 if st.aux_total is None else st.aux_total)
            if st.train and last:
                out = out + aux
            elif st.train:
                st.aux[key] = aux
        if st.train:
            st.outputs[key] = out
            self.live += 1
            self.peak_live = max(self.peak_live, self.live)
        elif not last:
            st.outputs[key] = out

    def _loss(self, out: Any, labels: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(out, labels)
        if not (isinstance(out, torch.Tensor) and out.dim() == 0):
            raise TypeError(
                "the last pipeline stage returned "
                f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}, not a scalar loss: "
                "pass loss_fn=... to PipelineModule (or to initialize)"
            )
        return out

    def _send_act(self, st: _Batch, ins: Instruction) -> None:
        key = (ins.mb, ins.chunk)
        out = st.outputs[key] if st.train else st.outputs.pop(key)
        self.links[ins.chunk].send_activation(out)

    def _recv_grad(self, st: _Batch, ins: Instruction) -> None:
        key = (ins.mb, ins.chunk)
        st.grads[key] = self.links[ins.chunk].recv_grads(st.outputs[key])

    def _backward(self, st: _Batch, ins: Instruction, sink: list | None = None) -> None:
        """The backward of (ins.mb, ins.chunk): from the loss / m * S on the last virtual
        stage, else from the received output gradient; with ``sink`` (B) the linears' weight
        work is left there instead of done."""
        key = (ins.mb, ins.chunk)
        sync = ins == st.last_backward
        self.strategy.before_backward(sync)
        out, aux = st.outputs.pop(key), st.aux.pop(key, None)
        if st.fused is not None:  # checkpointed layers recompute as their forward ran
            self.splitter.active = sink is not None
        with deferring(sink) if sink is not None else _UNTIMED:
            if self._is_last(ins.chunk):
                scaled = out / st.micro_batches
                (scaled * st.scale if st.scale != 1.0 else scaled).backward()
            else:
                grads = st.grads.pop(key)
                outs = [t for t in as_tuple(out, "a stage's output") if t.requires_grad]
                if aux is not None and aux.requires_grad:  # d(loss)/d(aux) = 1, times S / m
                    outs, grads = [*outs, aux], [*grads, _aux_grad(aux, st)]
                if outs:
                    torch.autograd.backward(outs, grads)
        del out, aux
        if not sync:
            self.strategy.after_backward(False)
        received = st.inputs.pop(key, None)  # the first stage dropped its input at forward
        if not self._is_first(ins.chunk):
            st.to_send[key] = received
        self.live -= 1

    def _backward_input(self, st: _Batch, ins: Instruction) -> None:
        """B: the input gradient; the weight work waits in ``st.deferred`` for W."""
        key = (ins.mb, ins.chunk)
        sink = st.deferred.setdefault(key, [])
        self._backward(st, ins, sink)
        st.deferred_any = st.deferred_any or bool(sink)
        if self.meter is not None:  # what W keeps alive: each linear's X and dY, once each
            kept = {t.untyped_storage().data_ptr(): t for d in sink for t in (d.x, d.dy)}
            st.held[key] = [self.meter.hold(t) for t in kept.values()]

    def _backward_weight(self, st: _Batch, ins: Instruction) -> None:
        """W: the weight gradients B left for (ins.mb, ins.chunk)."""
        key = (ins.mb, ins.chunk)
        work = st.deferred.pop(key)
        sync = ins == st.last_backward
        if not work and not sync:
            return
        self.strategy.before_backward(sync)
        weight_backward(work)
        del work
        st.held.pop(key, None)
        if not sync:
            self.strategy.after_backward(False)

    def _send_grad(self, st: _Batch, ins: Instruction) -> None:
        self.links[ins.chunk].send_grads(st.to_send.pop((ins.mb, ins.chunk)))

    def _forward_backward(self, st: _Batch, ins: Instruction) -> None:
        """F&B: the forward of (ins.mb, ins.chunk) and the full backward of ``ins.pair``, each
        with its messages (instructions.overlap_messages). Both receives are posted first, so
        the backward's gradient arrives while the forward computes, and the forward's output
        is sent (non-blocking) before the backward computes: on one CPU stream the two
        computations run in turn, each overlapping the other's communication. The same
        computations in the same order as the pair run one after the other: equal results."""
        f, b = units(ins)
        link_f, link_b = self.links[f.chunk], self.links[b.chunk]
        grad = None
        if not self._is_last(b.chunk):
            grad = link_b.post_grads(st.outputs[(b.mb, b.chunk)])
        if not self._is_first(f.chunk):
            with self._timed(st, "RECV_ACT"):
                st.inputs[(f.mb, f.chunk)] = link_f.post_activation(st.train).wait()
        with self._timed(st, "FORWARD"):
            self._forward(st, f)
        if not self._is_last(f.chunk):
            with self._timed(st, "SEND_ACT"):
                self._send_act(st, f)
        if grad is not None:
            with self._timed(st, "RECV_GRAD"):
                st.grads[(b.mb, b.chunk)] = grad.wait()
        with self._timed(st, "BACKWARD"):
            self._backward(st, b)
        if not self._is_first(b.chunk):
            with self._timed(st, "SEND_GRAD"):
                self._send_grad(st, b)

    def _timed(self, st: _Batch, op: str) -> Any:
        """The monitor's section of instruction ``op`` (``_dispatch`` times whole ones)."""
        name = PHASES.get(op) if st.train and self.section is not None else None
        return self.section(name) if name else _UNTIMED


def _aux_grad(aux: torch.Tensor, st: _Batch) -> torch.Tensor:
    """The gradient the last stage gives its loss, S / m, for an auxiliary term elsewhere."""
    return torch.ones_like(aux) * st.scale / st.micro_batches


def _cast(x: Any, dtype: torch.dtype) -> Any:
    """16-bit weights need 16-bit inputs; integer inputs (token ids) pass unchanged."""
    if dtype == torch.float32:
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(t, dtype) for t in x)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x
