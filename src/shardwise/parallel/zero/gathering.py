"""ZeRO-3 units, and the module hooks that gather them around each forward and backward.

A *unit* is one flat group of parameters gathered and released together (a module's direct
parameters of one optimizer group and dtype). Its P elements are laid end to end, padded to a
multiple of N (the data-parallel size) and split on that single axis into N shards of S = P/N;
rank r keeps only shard r between uses:

    shard_r = flat[r*S : (r+1)*S]                                    Psi/N per rank, persistent
    before use:  flat = all-gather(shard_0 .. shard_{N-1});  p.data = view of flat
    after use:   p.data = empty(0);  flat freed
    backward:    grad_shard_r += reduce-scatter(flat gradient)_r / N   (then the flat grad is freed)

A *persistent* unit (parameters below ``stage3_param_persistence_threshold`` elements) has one
part: its flat buffer is whole on every rank, never released; its gradient is all-reduced.

The schedule, for each module that uses units (its direct parameters, or a tied one):

    forward pre-hook          gather its units (or wait for their prefetch); prefetch the next
    forward post-hook         release them unless another user holds them; hook the outputs
    output-gradient hook      backward reaches the module: gather again; prefetch the previous
    post-accumulate-grad hook every gradient of a unit is final: reduce-scatter it, release it

A parameter's gradient is final only once every node that uses it has run, so releasing at
that point is safe even when a unit is used several times (tied weights). Prefetch follows
the order of the first forward (reversed in backward), at most ``prefetch_elements`` ahead and
never above ``max_live`` gathered elements; the gather a module needs always happens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from shardwise import comm
from shardwise.parallel.flat import FlatLayout
from shardwise.parallel.weak_hooks import weak_hook

_IN_FLIGHT = 2  # reduce-scatters in flight before the oldest is waited for (as in stage 2)


@dataclass
class LiveCount:
    """Elements currently gathered in non-persistent units (for stage3_max_live_parameters)."""

    elements: int = 0


@dataclass(eq=False)
class Unit:
    """One flat group of parameters; ``shard`` is all a rank keeps between uses."""

    layout: FlatLayout
    shard: torch.Tensor  # this rank's slice (compute dtype); the whole flat if persistent
    persistent: bool
    group: Any
    rank: int
    live: LiveCount
    master: nn.Parameter | None = None  # fp32 master of ``shard`` (a view of it when it can be)
    full: torch.Tensor | None = None  # the gathered flat buffer while the unit is live
    work: Any = None  # an all-gather in flight
    users: int = 0  # forward calls / GatheredParameters blocks holding the unit
    grad_shard: torch.Tensor | None = None
    ready: set = field(default_factory=set)  # parameters whose gradient is final this backward
    reduced: bool = False  # this backward's gradient has been sent
    send: torch.Tensor | None = None  # the flat gradient of a reduce-scatter in flight
    out: torch.Tensor | None = None
    rs_work: Any = None
    # Where gathered parameters and gradients live; None: the shard's device. Differs from
    # the shard's under offload_param (shard in host memory, compute on the accelerator).
    device: torch.device | None = None
    # (full, shard) -> handle: MiCS's two-hop gather (zero/mics.py); None: one over ``group``.
    gather: Any = None
    data: Any = None  # MiCS: all data ranks (``group`` is one replica's); None: ``group``
    # ZeRO++ (zero/quantized_comm.py): (full, shard) -> handle, the int8 gather used unless
    # ``exact``; (out, send) -> handle, the quantized reduce-scatter. None: unquantized.
    quantized: Any = None
    scatter: Any = None

    @property
    def data_group(self) -> Any:
        """Every rank holding this unit: a change broadcast over it reaches every replica."""
        return self.group if self.data is None else self.data

    @property
    def compute_device(self) -> torch.device:
        return self.device if self.device is not None else self.shard.device

    @property
    def params(self) -> list[nn.Parameter]:
        return self.layout.params

    @property
    def trainable(self) -> int:
        return sum(p.requires_grad for p in self.params)

    def start_gather(self, exact: bool = False) -> None:
        """Launch the all-gather of the flat parameters (no-op if live or persistent);
        ``exact``: never quantized (GatheredParameters, saving)."""
        if self.persistent or self.full is not None:
            return
        self.full = torch.empty(
            self.layout.padded, dtype=self.shard.dtype, device=self.compute_device
        )
        # Offloaded: copy the shard up first (the collective runs on the compute device).
        shard = self.shard.to(self.compute_device, non_blocking=True)
        gather = (
            (None if exact else self.quantized)
            or self.gather
            or partial(comm.all_gather_into_tensor, group=self.group, async_op=True)
        )
        self.work = gather(self.full, shard)
        self.live.elements += self.layout.padded

    def materialize(self, exact: bool = False) -> None:
        """Gather if needed, wait, and point every parameter at its view of the flat buffer."""
        self.start_gather(exact)
        if self.work is not None:
            self.work.wait()
            self.work = None
            for i, p in enumerate(self.params):
                p.data = self.layout.view(self.full, i)

    def release(self) -> None:
        """Drop the gathered buffer (parameters become empty) unless a user still holds it."""
        if self.persistent or self.full is None or self.users > 0:
            return
        if self.work is not None:  # a prefetch nobody used: finish it before freeing its buffer
            self.work.wait()
            self.work = None
        for p in self.params:
            p.data = self.full.new_empty(0)
        self.full = None
        self.live.elements -= self.layout.padded

    def launch_reduce(self) -> None:
        """Flatten the gradients (missing ones as zero), free them, reduce-scatter async."""
        send = torch.zeros(self.layout.padded, dtype=self.shard.dtype, device=self.compute_device)
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.layout.view(send, i).copy_(p.grad)
                p.grad = None
        self.send, self.reduced = send, True
        self.out = torch.empty(self.layout.shard_numel, dtype=send.dtype, device=send.device)
        scatter = self.scatter or partial(
            comm.reduce_scatter_tensor, group=self.group, async_op=True
        )
        self.rs_work = scatter(self.out, send)

    def drain(self, world: int) -> None:
        """Wait for the reduce-scatter and fold (1/N) * sum into the gradient shard."""
        self.rs_work.wait()
        self.grad_shard.add_(self.out.div_(world))
        self.send = self.out = self.rs_work = None

    def allreduce_grads(self, world: int) -> None:
        """Persistent unit: the mean of every rank's accumulated gradient, whole on each rank."""
        flat = torch.zeros(self.layout.padded, dtype=self.shard.dtype, device=self.shard.device)
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.layout.view(flat, i).copy_(p.grad)
                p.grad = None
        comm.all_reduce(flat, group=self.group)
        self.grad_shard = flat.div_(world)

    def absorb(self, src: int) -> None:
        """After an in-place change on global rank ``src`` (GatheredParameters): broadcast it,
        re-cut this rank's shard and refresh the fp32 master."""
        whole = self.shard if self.persistent else self.full
        comm.broadcast(whole, src=src, group=self.data_group)
        if not self.persistent:
            self.shard.copy_(self.layout.shard(whole, self.rank))
        if hasattr(self.gather, "refill"):  # hpZ: its secondary shard too (zero/hpz.py)
            self.gather.refill(whole)
        if self.master is not None and self.master.data_ptr() != self.shard.data_ptr():
            self.master.data.copy_(self.shard.float())


def _in_backward() -> bool:
    """True while autograd runs a backward on this thread (a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


class GatherScheduler:
    """Installs the hooks of the module docstring on ``root`` and runs the schedule."""

    def __init__(
        self,
        root: nn.Module,
        units_of: dict[nn.Module, list[Unit]],
        units: list[Unit],
        world: int,
        prefetch_elements: int,
        max_live: int,
    ) -> None:
        self.units = [u for u in units if not u.persistent]
        self.world = world
        self.prefetch_elements = prefetch_elements
        self.max_live = max_live
        self.live = self.units[0].live if self.units else LiveCount()
        self.order: list[Unit] = []  # unit uses in the first forward, one entry per use
        self.last_use: dict[int, int] = {}  # id(unit) -> its last position in ``order``
        self.recording = True
        self.cursor = 0
        self.in_flight: list[Unit] = []
        self.handles = [root.register_forward_pre_hook(self._begin, prepend=True)]
        for module, mine in units_of.items():
            mine = [u for u in mine if not u.persistent]
            if mine:
                self.handles.append(module.register_forward_pre_hook(partial(self._pre, mine)))
                self.handles.append(module.register_forward_hook(partial(self._post, mine)))
        self.handles.append(root.register_forward_hook(self._end))
        for u in self.units:
            for p in u.params:
                if p.requires_grad:
                    self.handles.append(
                        p.register_post_accumulate_grad_hook(weak_hook(self._on_grad, u))
                    )

    # ------------------------------------------------------------------ forward
    def _begin(self, module: nn.Module, args: Any) -> None:
        self.cursor = 0

    def _pre(self, mine: list[Unit], module: nn.Module, args: Any) -> None:
        if _in_backward():  # an activation-checkpoint recompute: see _recompute
            self._recompute(mine)
            return
        for u in mine:
            u.users += 1
            u.start_gather()  # launched before the prefetch: same order on every rank
        if self.recording:
            self.order.extend(mine)
        else:
            self.cursor += len(mine)
            self._prefetch(range(self.cursor, len(self.order)))
        for u in mine:
            u.materialize()

    def _post(self, mine: list[Unit], module: nn.Module, args: Any, output: Any) -> None:
        if not _in_backward():  # a recompute neither counted a user nor releases (_recompute)
            for u in mine:
                u.users -= 1
                u.release()
        if torch.is_grad_enabled():
            for t in tree_leaves(output):
                # A leaf output would keep the hook forever; it has no backward of its own.
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                    t.register_hook(partial(self._pre_backward, mine))

    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.recording:
            self.recording = False
            self.last_use = {id(u): i for i, u in enumerate(self.order)}
        self.release_all()  # prefetched units the forward did not reach

    # ------------------------------------------------------------------ backward
    def _pre_backward(self, mine: list[Unit], grad: torch.Tensor) -> None:
        for u in mine:
            u.start_gather()
        if self.last_use:
            start = min(self.last_use.get(id(u), 0) for u in mine)
            self._prefetch(range(start - 1, -1, -1))
        for u in mine:
            u.materialize()

    def _recompute(self, mine: list[Unit]) -> None:
        """Gather for a forward run inside backward (activation checkpointing's recompute).

        The unit is kept until its gradient is reduced (``_reduce``) or the backward ends
        (``finish_backward``), not released by the post-hook: torch's non-reentrant checkpoint
        stops the recompute as soon as the last saved tensor is rebuilt, often inside the
        block's last Linear, whose post-hook then never runs; and when the recompute does run
        to the end, the backward that follows still reads the saved weight (a view of the
        gathered buffer). Counting no user here means no count can be left behind."""
        for u in mine:
            u.materialize()

    def _on_grad(self, u: Unit, p: nn.Parameter) -> None:
        u.ready.add(id(p))
        if len(u.ready) == u.trainable and not u.reduced:
            self._reduce(u)

    def _reduce(self, u: Unit) -> None:
        u.launch_reduce()
        u.release()
        self.in_flight.append(u)
        while len(self.in_flight) > _IN_FLIGHT:
            self.in_flight.pop(0).drain(self.world)

    def finish_backward(self) -> None:
        """Send every unit the hooks did not (zeros where no gradient came, so that every rank
        issues the same collectives), wait for all, release everything still gathered."""
        for u in self.units:
            if not u.reduced:
                self._reduce(u)
        for u in self.in_flight:
            u.drain(self.world)
        self.in_flight.clear()
        for u in self.units:
            u.ready.clear()
            u.reduced = False
        self.release_all()

    # ------------------------------------------------------------------ shared
    def _prefetch(self, positions: range) -> None:
        """Start the gathers of the next units in ``positions``, within both budgets."""
        fetched = 0
        for j in positions:
            if fetched >= self.prefetch_elements:
                break
            u = self.order[j]
            if u.full is not None or u.reduced:
                continue
            if self.live.elements + u.layout.padded > self.max_live:
                break
            u.start_gather()
            fetched += u.layout.padded

    def release_all(self) -> None:
        for u in self.units:
            u.release()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
