"""Data parallelism: gradients all-reduced in buckets while backward is still running.

Every data-parallel rank holds the whole model and computes gradients on its own micro-batch.
With the loss of each rank a mean over its b samples, the gradient of the mean over the global
batch of N*b samples is

    g = (1/N) * sum_r g_r

so each gradient is divided by N as it enters its bucket and the bucket is summed over the
data-parallel group.

Buckets: parameters are taken in reverse registration order (roughly the order backward
produces their gradients) and packed into flat buffers of about ``bucket_elements``. Each
parameter's ``.grad`` is a view into its bucket buffer, so autograd accumulates straight into
the buffer and nothing is copied before sending. A per-parameter hook fires once the gradient
is fully accumulated; when a bucket's last gradient arrives, it is copied into the bucket
already multiplied by 1/N (one pass, as torch DDP's reducer does: a separate division of the
summed bucket was a second pass over the gradient, 0.9% of a step in benchmarks/dp.py), and its
all-reduce is launched asynchronously while the next layers' backward runs. With N a power of
two, sum_r (g_r / N) equals (sum_r g_r) / N bit for bit. ``after_backward`` waits for all
buckets and launches any bucket whose parameters got no gradient (unused in this step), so
every rank issues the same collectives in the same order.

On accumulation micro-steps that are not the boundary the hooks do nothing: gradients keep
accumulating locally and only the last micro-step communicates.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardwise import comm
from shardwise.checkpoint.rank_pieces import Layout, replicated_layout
from shardwise.comm import Group
from shardwise.parallel import clip
from shardwise.parallel.data.replica_groups import get_replicas, has_replicas, partition_by_replicas
from shardwise.parallel.flat import FlatLayout, plan_buckets
from shardwise.parallel.strategy_contract import StrategyContext, bucket_elements, plain_precision
from shardwise.parallel.weak_hooks import weak_hook

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup
    from torch.optim import Optimizer

    from shardwise.topology import ProcessMesh


@dataclass
class _Bucket:
    layout: FlatLayout
    buffer: torch.Tensor
    group: Group = None  # the data ranks holding copies of these parameters (replica_groups.py)
    counted: bool = True  # this rank counts the bucket in the gradient norm
    solo: bool = False  # no other rank holds these parameters: nothing to reduce
    work: Any = None
    ready: set = field(default_factory=set)


class Finished:
    """The handle of a reduction over one rank: nothing to wait for."""

    def wait(self) -> None:
        pass


class DataParallelReducer:
    """Bucketed, overlapped gradient all-reduce over one data-parallel group.

    The engine's gradient strategy for stage 0 in full precision: every rank keeps the whole
    gradient, the user's optimizer steps the user's parameters.
    """

    supports_no_sync = True
    optimizer = None  # the user's optimizer steps the user's parameters

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        group: ProcessGroup | None = None,
        bucket_elements: int = 2**22,
        norm_skip: frozenset[int] = frozenset(),
        ranks: list[int] | None = None,
    ) -> None:
        self.norm_skip = norm_skip
        self.group = group
        self.world = comm.get_world_size(group)
        # True only inside the engine's boundary backward: a backward through this model run
        # by another engine (a GAN's generator step through the discriminator) reduces nothing.
        self.sync = False
        self._hooks: list[Any] = []
        ranks = ranks if ranks is not None else list(range(self.world))
        parts = partition_by_replicas(list(params), group, ranks)
        me = comm.get_rank() if self.world > 1 else ranks[0]
        self.buckets = [
            _Bucket(lay, lay.new_buffer(), rep.group, rep.ranks[0] == me, len(rep.ranks) == 1)
            for rep, ps in parts
            for lay in plan_buckets(ps, bucket_elements)
        ]
        # Every rank ends the step with the same full gradient: the norm needs no communication.
        # With parameters held by part of the group (experts), each copy is counted by the
        # first rank holding it and the squares are summed over the data-parallel group.
        self.norm_group = clip.LOCAL if len(parts) == 1 else group
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.layout.params)}
        if self.world > 1:
            for b in self.buckets:
                for p in b.layout.params:
                    self._hooks.append(
                        p.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
                    )
        self._bind_grads()

    # -- gradients as views of the buckets
    def _bind(self, p: torch.nn.Parameter) -> None:
        """Make ``p.grad`` its bucket view, keeping any gradient the user put there."""
        b, i = self._slot[id(p)]
        view = b.layout.view(b.buffer, i)
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def _bind_grads(self) -> None:
        for b in self.buckets:
            for p in b.layout.params:
                self._bind(p)

    def owned_grads(self) -> list[torch.Tensor]:
        """The gradients whose squares make up the global norm (all of them, once).

        ``norm_skip`` holds the ids of parameters another tensor-parallel rank counts."""
        buckets = [b for b in self.buckets if b.counted or self.norm_group == clip.LOCAL]
        if not self.norm_skip:
            return [b.buffer for b in buckets]
        return [
            b.layout.view(b.buffer, i)
            for b in buckets
            for i, p in enumerate(b.layout.params)
            if id(p) not in self.norm_skip
        ]

    def reduced_grads(self, p: torch.nn.Parameter) -> list[torch.Tensor]:
        """After the reduction: ``p``'s averaged gradient (a view of its bucket)."""
        return [p.grad]

    def zero_grad(self) -> None:
        """Drop the gradients: autograd then hands each parameter a fresh one, which the
        bucket takes in at launch (one copy), instead of zeroing the buckets and adding into
        them (two passes over the gradient; measured in benchmarks/README.md)."""
        for b in self.buckets:
            for p in b.layout.params:
                p.grad = None

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The bucket buffers hold the gradients, whether or not ``p.grad`` points at them."""
        return {"grads": [b.buffer for b in self.buckets]}

    # -- the backward pass
    def before_backward(self, sync: bool) -> None:
        """Only a boundary micro-step communicates; the others accumulate locally."""
        self.sync = sync

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.sync:
            return
        b, _ = self._slot[id(p)]
        if b.work is not None or id(p) in b.ready:
            return
        b.ready.add(id(p))
        if len(b.ready) == len(b.layout.params):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        scale = 1.0 / self.world
        for i, p in enumerate(b.layout.params):
            view = b.layout.view(b.buffer, i)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                torch.mul(p.grad, scale, out=view)  # the copy and the average in one pass
            else:  # accumulated in place (no zero_grad since the last step)
                view.mul_(scale)
            p.grad = view
        b.work = Finished() if b.solo else comm.all_reduce(b.buffer, group=b.group, async_op=True)

    def after_backward(self, sync: bool) -> None:
        """At the boundary: wait for every bucket (launching those with unused parameters;
        each was averaged as it was filled). Elsewhere gradients just accumulate."""
        self.sync = False  # until the next before_backward
        if not sync:
            return
        if self.world == 1:
            self._bind_grads()
            return
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        for b in self.buckets:
            b.work.wait()
            b.work = None
            b.ready.clear()

    def step(self, optimizer: torch.optim.Optimizer, coef: float) -> None:
        """Scale the (clipped) gradients by ``coef`` and run the user's optimizer."""
        if coef != 1.0:
            for b in self.buckets:
                b.buffer.mul_(coef)
        optimizer.step()

    def consolidated_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @classmethod
    def accepts(cls, ctx: StrategyContext) -> bool:
        return plain_precision(ctx) and ctx.mesh.topology.dp_cp > 1

    @classmethod
    def from_context(cls, ctx: StrategyContext) -> DataParallelReducer:
        params, group, ranks = ctx.model.parameters(), ctx.mesh.dp_cp_group, ctx.mesh.dp_cp_ranks()
        return cls(params, group, bucket_elements(ctx.config), ctx.norm_skip, ranks)

    def checkpoint_layout(
        self, module: torch.nn.Module, optimizer: Optimizer, mesh: ProcessMesh
    ) -> Layout:
        return replicated_layout(module, optimizer, mesh)


def broadcast_parameters(
    module: torch.nn.Module, src: int, group: ProcessGroup | None = None
) -> None:
    """Make every rank of ``group`` start from global rank ``src``'s weights and buffers (a
    parameter held by part of the group, replica_groups.py: from the first rank of its copies;
    meta-device tensors have no values yet: they are drawn alike on every rank later)."""
    if comm.get_world_size(group) == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.is_meta:
                continue
            if not has_replicas(t):  # held by the whole group: from src
                comm.broadcast(t.data, src=src, group=group)
                continue
            # A tensor whose copies live on part of the group (an expert, replica_groups.py): from
            # the first copy, and nothing when this rank holds the only one. (A one-rank
            # group may be recorded as None, which torch reads as the world: broadcasting on
            # it from each rank's own copy deadlocked GPT-MoE at TP2, found by verify --fuzz.)
            rep = get_replicas(t, group, [src])
            if len(rep.ranks) > 1:
                comm.broadcast(t.data, src=rep.ranks[0], group=rep.group)


class LocalGradients:
    """The gradient strategy of a single data-parallel rank: nothing to reduce, no buckets.

    Gradients stay the tensors autograd made, so one process costs what a plain loop costs.
    """

    norm_group = clip.LOCAL
    supports_no_sync = True
    optimizer = None  # the user's optimizer steps the user's parameters

    def __init__(
        self, params: Iterable[torch.nn.Parameter], norm_skip: frozenset[int] = frozenset()
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.norm_skip = norm_skip

    @classmethod
    def accepts(cls, ctx: StrategyContext) -> bool:
        return plain_precision(ctx) and ctx.mesh.topology.dp_cp == 1

    @classmethod
    def from_context(cls, ctx: StrategyContext) -> LocalGradients:
        return cls(ctx.model.parameters(), ctx.norm_skip)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {}  # the module's parameters and gradients, the optimizer's state: the defaults

    def checkpoint_layout(
        self, module: torch.nn.Module, optimizer: Optimizer, mesh: ProcessMesh
    ) -> Layout:
        return replicated_layout(module, optimizer, mesh)

    def close(self) -> None:
        pass  # no hooks

    def before_backward(self, sync: bool) -> None:
        pass

    def after_backward(self, sync: bool) -> None:
        pass

    def owned_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None and id(p) not in self.norm_skip]

    def reduced_grads(self, p: torch.nn.Parameter) -> list[torch.Tensor]:
        """``p``'s gradient (zeros when this rank's backward did not reach it)."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return [p.grad]

    def step(self, optimizer: torch.optim.Optimizer, coef: float) -> None:
        if coef != 1.0:  # every gradient, also those the norm counts on another rank
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], coef)
        optimizer.step()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def consolidated_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
