"""ZeRO stages 1 and 2: optimizer states (and gradients) partitioned over data-parallel ranks.

Every bucket of parameters is one flat buffer of P elements padded to a multiple of N (the
data-parallel size) and cut into N equal shards; rank r owns shard r of every bucket:

    shard_r = flat[r*P/N : (r+1)*P/N]

Rank r keeps the fp32 master weights and the optimizer states of its shards only (12P/N bytes
for Adam instead of 12P), and steps them alone (fp16 masters and gradient shards with
``fp16_master_weights_and_grads``, DeepSpeedCPUAdam keeping its states in fp32). One step, per bucket:

    reduce-scatter(gradients) -> rank r holds (1/N) * sum_ranks g[shard_r]
    optimizer step on shard_r (the master copy) -> write shard_r of the 16/32-bit parameters
    all-gather(parameters)    -> every rank again holds the whole updated model

Volume: (N-1)/N * P for each collective, 2(N-1)/N * P in all: the same as one all-reduce.

Stage 1 keeps the full gradient buffer: gradients accumulate locally over micro-steps and the
reduce-scatter runs on the boundary only (launched per bucket from gradient hooks, overlapped
with backward). Stage 2 frees the full gradient as soon as its bucket is reduce-scattered: every
micro-step sends its bucket and the rank accumulates only its shard, so no rank holds a full
gradient after backward. Stage 0 with 16-bit training is the same machinery with one part
(all-reduce, replicated fp32 masters).

The user's optimizer steps the master shards instead of the parameters, each of its parameter
groups keeping its hyper-parameters (masters.py); elementwise optimizers (SGD, Adam, AdamW,
Adagrad...) then compute exactly what they compute unsharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch

from shardwise import comm
from shardwise.checkpoint.rank_pieces import FlatShard, Layout, flat_layout
from shardwise.comm import Group
from shardwise.parallel import clip
from shardwise.parallel.data.reducer import Finished
from shardwise.parallel.data.replica_groups import partition_by_replicas
from shardwise.parallel.flat import FlatLayout, plan_buckets
from shardwise.parallel.strategy_contract import (
    StrategyContext,
    bucket_elements,
    offload_device,
    require_optimizer,
)
from shardwise.parallel.weak_hooks import weak_hook
from shardwise.parallel.zero.buckets import Bucket, Where
from shardwise.parallel.zero.masters import rebind_optimizer, shares_storage
from shardwise.parallel.zero.mics import ZeroGroups
from shardwise.parallel.zero.quantized_comm import quantized_reduce_scatter
from shardwise.precision import master_dtype

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup
    from torch.optim import Optimizer

    from shardwise.topology import ProcessMesh

_IN_FLIGHT = 2  # stage 2: reduce-scatters in flight before the oldest is waited for


class ZeroStrategy:
    """The engine's gradient strategy for ZeRO stages 1-2 (and 16-bit stage 0)."""

    quantized_gradients = False  # reduce-scatters by ZeRO++'s qgZ (zero/quantized_comm.py)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stage: int,
        group: ProcessGroup | None = None,
        bucket_elements: int = 2**22,
        offload_device: torch.device | None = None,
        isolate: Sequence[torch.nn.Parameter] = (),
        master_dtype: torch.dtype = torch.float32,
        norm_skip: frozenset[int] = frozenset(),
        ranks: list[int] | None = None,
        groups: ZeroGroups | None = None,
    ) -> None:
        """``isolate``: parameters that get a bucket each, laid out alike on every rank that
        holds them (a weight tied across pipeline stages: shard r covers the same elements
        on each stage, so the stages can sum their shards; see ``reduced_grads``).
        ``master_dtype``: fp16 under ``fp16_master_weights_and_grads`` (precision.py).
        ``groups``: MiCS (zero/mics.py), ``group`` and ``ranks`` being its shard group's."""
        self.groups = groups or ZeroGroups.flat(group, ranks)
        self.stage = stage
        self.norm_skip = norm_skip
        self.master_dtype = master_dtype
        self.group = group
        self.world = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.parts = self.world if stage >= 1 else 1
        self.offload_device = offload_device
        self.sync = True
        # Hooks act inside the engine's backward only (before_backward .. after_backward): a
        # backward through this model run by another engine (a GAN's generator step through
        # the discriminator) leaves its gradients in p.grad, for zero_grad to drop.
        self._armed = False
        self._in_flight: list[Bucket] = []
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        alone = {id(p): i for i, p in enumerate(isolate)}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        params = [p for p in params if id(p) not in alone] + [p for p in isolate]
        ranks = ranks if ranks is not None else list(range(self.world))
        self.buckets = []
        for rep, ps in partition_by_replicas(params, group, ranks):
            where = self._where(rep.group, rep.ranks)
            layouts = plan_buckets(
                ps,
                bucket_elements,
                where.parts,
                key=lambda p: (p.dtype, p.device, group_of[id(p)], alone.get(id(p), -1)),
            )
            self.buckets += [self._make_bucket(lay, where) for lay in layouts]
        # Each element counted once over the data group: a shard by its owner, a replicated
        # bucket by the first rank holding it; without shards nor experts, nothing to sum.
        counted = {id(b.where) for b in self.buckets}
        self.norm_group = group if self.parts > 1 or len(counted) > 1 else clip.LOCAL
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.layout.params)}
        self.optimizer = rebind_optimizer(optimizer, self.buckets, group_of)
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
            for b in self.buckets
            for p in b.layout.params
        ]
        self.zero_grad()

    # ------------------------------------------------------------------ construction
    def _where(self, group: Group, ranks: tuple[int, ...]) -> Where:
        size = len(ranks) if self.world > 1 else 1
        parts = size if self.stage >= 1 else 1
        mine = ranks.index(comm.get_rank()) if size > 1 else 0
        return Where(group, size, mine if parts > 1 else 0, parts)

    def _make_bucket(self, layout: FlatLayout, where: Where) -> Bucket:
        flat = layout.new_buffer()
        layout.gather_into(flat, "data")
        for i, p in enumerate(layout.params):
            p.data = layout.view(flat, i)
        shard = layout.shard(flat, where.shard)
        if shard.dtype == self.master_dtype and self.offload_device is None:
            master = torch.nn.Parameter(shard, requires_grad=True)  # shares storage: no copy
        else:
            device = self.offload_device or shard.device
            master = torch.nn.Parameter(shard.detach().to(device, self.master_dtype, copy=True))
        return Bucket(where=where, layout=layout, params_flat=flat, master=master)

    # ------------------------------------------------------------------ backward
    def before_backward(self, sync: bool) -> None:
        self.sync, self._armed = sync, True

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        b, i = self._slot[id(p)]
        if self.stage >= 2:
            if b.grads_flat is None:
                b.grads_flat = b.layout.new_buffer()
            b.layout.view(b.grads_flat, i).copy_(p.grad)
            p.grad = None  # the full gradient lives only until its bucket is sent
        elif not self.sync:
            return
        if b.sent or id(p) in b.ready:
            return
        b.ready.add(id(p))
        if len(b.ready) == len(b.layout.params):
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        b.sent = True
        if self.stage >= 2:
            if b.grads_flat is None:  # no parameter of this bucket was used this micro-step
                b.grads_flat = b.layout.new_buffer()
        else:
            self._bind_grads(b)
        # Divide before summing: N partial gradients of 16-bit values may overflow where their
        # mean does not (N a power of two divides exactly).
        b.grads_flat.div_(self.groups.scale)
        w = b.where
        if w.size == 1:  # no other copy: the local gradient, divided, is the reduced one
            b.out, b.work = b.grads_flat, Finished()
        elif w.parts == 1:
            b.out = b.grads_flat
            b.work = comm.all_reduce(b.out, group=w.group, async_op=True)
        else:
            # Stage 1 reduces in place (the shard is a view of the full buffer); stage 2 into a
            # fresh shard, so that the full buffer can be freed once the send is done.
            b.out = (
                b.layout.shard(b.grads_flat, w.shard)
                if self.stage == 1
                else torch.empty(
                    b.layout.shard_numel, dtype=b.grads_flat.dtype, device=b.grads_flat.device
                )
            )
            scatter = (
                partial(quantized_reduce_scatter, group=w.group)
                if self.quantized_gradients
                else partial(comm.reduce_scatter_tensor, group=w.group, async_op=True)
            )
            b.work = scatter(b.out, b.grads_flat)
        if self.stage >= 2:
            self._in_flight.append(b)
            while len(self._in_flight) > _IN_FLIGHT:
                self._drain(self._in_flight.pop(0))

    def _drain(self, b: Bucket) -> None:
        """Wait for a bucket's reduction and fold it into this rank's gradient shard."""
        b.work.wait()
        if self.stage >= 2:
            b.grad_shard.add_(b.out)  # accumulate over micro-steps, in the compute dtype
            b.grads_flat = None
        else:
            b.grad_shard = b.out
        b.work, b.out = None, None
        b.ready.clear()

    def after_backward(self, sync: bool) -> None:
        """Finish every bucket's reduction: on the boundary (stage 1), every micro-step (2).

        Buckets whose parameters got no gradient are sent too (as zeros), so every rank
        issues the same collectives in the same order."""
        self._armed = False
        if self.stage < 2 and not sync:
            return
        for b in self.buckets:
            if not b.sent:
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                self._drain(b)
            b.sent = False
        self._in_flight.clear()
        if sync:  # MiCS: each shard summed over its replicas, once per step
            self.groups.allreduce([b.grad_shard for b in self.buckets])

    # ------------------------------------------------------------------ step
    def owned_grads(self) -> list[torch.Tensor]:
        """Each element of the global gradient once: this rank's reduced shards (without the
        parameters in ``norm_skip``, which another tensor-parallel rank counts)."""
        local = self.norm_group == clip.LOCAL
        shards = [
            b
            for b in self.buckets
            if b.grad_shard is not None and (local or b.where.parts > 1 or self._first(b))
        ]
        if not self.norm_skip:
            return [b.grad_shard for b in shards]
        return [
            b.grad_shard[at : at + n]
            for b in shards
            for i, _, at, n in b.layout.overlaps(b.where.shard)
            if id(b.layout.params[i]) not in self.norm_skip
        ]

    def _first(self, b: Bucket) -> bool:
        """This rank is the first of those holding the bucket's (replicated) parameters."""
        return b.where.size == 1 or comm.get_rank(b.where.group) == 0

    def reduced_grads(self, p: torch.nn.Parameter) -> list[torch.Tensor]:
        """After the reduction: the part of ``p``'s gradient this rank holds (views, so that
        an in-place sum over tied copies lands in the shard)."""
        b, i = self._slot[id(p)]
        if b.where.parts > 1 and len(b.layout.params) > 1:
            raise RuntimeError("a tied parameter must have a bucket of its own: pass it in isolate")
        if b.grad_shard is None:
            return []
        overlaps = b.layout.overlaps(b.where.shard)
        return [b.grad_shard[at : at + n] for j, _, at, n in overlaps if j == i]

    def step(self, optimizer: Optimizer, coef: float) -> None:
        """Step the master shards with gradients * coef, then all-gather the parameters."""
        for b in self.buckets:
            g = b.grad_shard if b.grad_shard is not None else torch.zeros_like(b.master)
            g = g.to(b.master.device, b.master.dtype)  # a no-op for fp32 without offload
            b.master.grad = g * coef if coef != 1.0 else g
        self.optimizer.step()
        works = []
        for b in self.buckets:
            b.master.grad = None
            local = b.layout.shard(b.params_flat, b.where.shard)
            if local.data_ptr() != b.master.data_ptr():
                local.copy_(b.master.detach())
            if b.where.parts > 1:  # in place: this rank's input is its slice of the output
                works.append(
                    comm.all_gather_into_tensor(
                        b.params_flat, local, group=b.where.group, async_op=True
                    )
                )
        for w in works:
            w.wait()

    def zero_grad(self) -> None:
        for b in self.buckets:
            if self.stage >= 2:
                # The shard persists (the ZeRO paper counts it: 2 Psi / N in 16 bits).
                if b.grad_shard is None:
                    lay = b.layout
                    b.grad_shard = torch.zeros(lay.shard_numel, dtype=lay.dtype, device=lay.device)
                b.grad_shard.zero_()
                for p in b.layout.params:
                    p.grad = None
            else:
                b.grad_shard = None
                if b.grads_flat is None:
                    b.grads_flat = b.layout.new_buffer()
                b.grads_flat.zero_()
                self._bind_grads(b)

    def _bind_grads(self, b: Bucket) -> None:
        """Stage 1 / 0: every ``p.grad`` is a view of the bucket's full gradient buffer."""
        for i, p in enumerate(b.layout.params):
            view = b.layout.view(b.grads_flat, i)
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    # ------------------------------------------------------------------ state
    def consolidated_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Parameters are whole on every rank after each step: the module's own state."""
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors holding this rank's model states, by kind (for memory_breakdown)."""
        opt_state = [
            t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        ]
        # A master that is a view of the parameters (fp32, no offload) costs nothing extra.
        masters = [
            b.master.data for b in self.buckets if not shares_storage(b.master, b.params_flat)
        ]
        grads = [b.grads_flat for b in self.buckets if b.grads_flat is not None and self.stage < 2]
        grads += [
            b.grad_shard for b in self.buckets if b.grad_shard is not None and self.stage >= 2
        ]
        return {
            "params": [b.params_flat for b in self.buckets],
            "grads": grads,
            "optimizer": masters + opt_state,
            "comm_buffers": [
                b.grads_flat for b in self.buckets if self.stage >= 2 and b.grads_flat is not None
            ],
        }

    supports_no_sync = property(lambda self: self.stage < 2)

    @classmethod
    def accepts(cls, ctx: StrategyContext) -> bool:
        return True  # stages 1-2, and stage 0 in 16 bits or offloaded: the last of the table

    @classmethod
    def from_context(cls, ctx: StrategyContext) -> ZeroStrategy:
        cfg, opt, groups = ctx.config, require_optimizer(ctx), ZeroGroups.from_mesh(ctx.mesh)
        made = cls(
            opt,
            cfg.zero_optimization.stage,
            group=groups.shard,
            bucket_elements=bucket_elements(cfg),
            offload_device=offload_device(cfg),
            isolate=ctx.isolate,
            master_dtype=master_dtype(cfg, opt),
            norm_skip=ctx.norm_skip,
            ranks=groups.shard_ranks,
            groups=groups,
        )
        made.quantized_gradients = cfg.zero_optimization.zero_quantized_gradients  # stage 2
        return made

    def checkpoint_layout(
        self, module: torch.nn.Module, optimizer: Optimizer, mesh: ProcessMesh
    ) -> Layout:
        """Whole model weights on every rank; masters and states as this rank's flat shard of
        each bucket (the one shard, replicated, at stage 0)."""
        shards = [
            FlatShard(
                b.layout,
                b.where.shard,
                b.master,
                not shares_storage(b.master, b.params_flat),
                b.where.parts == 1,
                holders=self.groups.holders,
            )
            for b in self.buckets
        ]
        return flat_layout(module, mesh, shards)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
