"""ZeRO stage 3: parameters, gradients and optimizer states all partitioned over data ranks.

Each module's direct parameters (``module.parameters(recurse=False)``) that the optimizer
trains form units, one per optimizer group and dtype: a flat buffer of P elements padded to a
multiple of N and split on its only axis into N shards; rank r keeps shard r of the
parameters, of the gradient and of the optimizer state (zero/gathering.py has the layout and the
gather/release schedule). Per rank, for Psi parameters with Adam (ZeRO, arXiv 1910.02054, 5.3):

    bf16 + fp32 master:  (2 + 2 + 12) Psi / N     (shard, gradient shard, master + 2 states)
    fp32:                (4 + 4 +  8) Psi / N     (the master *is* the parameter shard)

up to padding (< N elements per unit). Parameters with fewer than ``persistence_threshold``
elements (DeepSpeed's ``stage3_param_persistence_threshold``) stay whole on every rank, with
whole gradients (all-reduced on the boundary) and whole optimizer states: ZeRO-0 for the small
tensors whose gathers would cost more latency than memory.

One step at GAS = 1 sends, per unit of P elements (ring model, comm.py):

    forward all-gather (N-1)/N P + backward all-gather (N-1)/N P + reduce-scatter (N-1)/N P
    = 3 (N-1)/N P  =  1.5x the all-reduce of plain data parallelism, 2 (N-1)/N P.

The step updates the fp32 master shard and writes it into the parameter shard; nothing is sent
then (the next forward gathers). Gradients are reduce-scattered every micro-step (the full
gradient cannot wait: its parameters are released) and accumulate in the gradient shard.
Norm for clipping: every rank's reduced shards, summed over the group, plus the persistent
gradients once (rank 0 adds them).

``offload_param`` keeps each rank's shards on the offload device (host memory) between uses:
a gather first copies the shard to the compute device, where the gathered flat buffer, the
gradients and the gradient shard live; the optimizer step reads the gradient shard on the
master's device and writes the new values back into the offloaded shard. With
``offload_optimizer`` too, master and states are in host memory and the step runs there.

Why units are per module (DeepSpeed's choice) rather than per block (FSDP's): the hooks need
no wrapping policy, a tied or reused parameter belongs to one unit that every module using it
gathers, and the live memory is one module plus the prefetch window; prefetch hides the
latency that finer units add. Limits: a parameter read outside the forward of a module that
owns it (``x @ self.fc.weight`` in the parent) is not gathered (DeepSpeed's
``register_external_parameter`` is not implemented); parameters the optimizer does not train
stay whole; ``stage3_max_reuse_distance``, ``stage3_module_granularity_threshold`` and
``stage3_use_all_reduce_for_fetch_params`` are not used (every unit is released after use and
fetched by all-gather). With activation checkpointing, the recompute in backward runs the
forward hooks again, which gather the units it needs (tests/test_activation_checkpointing.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise import comm
from shardwise.checkpoint.rank_pieces import FlatShard, Layout, flat_layout
from shardwise.parallel import clip
from shardwise.parallel.compile import region_of
from shardwise.parallel.flat import FlatLayout
from shardwise.parallel.strategy_contract import StrategyContext, offload_device, require_optimizer
from shardwise.parallel.zero.gathering import GatherScheduler, LiveCount, Unit
from shardwise.parallel.zero.masters import rebind_optimizer, shares_storage
from shardwise.parallel.zero.mics import ZeroGroups
from shardwise.parallel.zero.partition import (
    full_value,
    is_partitioned,
    materialize_meta,
    numel,
    sync_rng,
    unpartition,
)
from shardwise.parallel.zero.quantized_comm import quantize_units

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup
    from torch.optim import Optimizer

    from shardwise.config.zero import ZeroConfig
    from shardwise.topology import ProcessMesh


class Zero3Strategy:
    """The engine's gradient strategy for ZeRO stage 3 (see engine.py for the protocol)."""

    supports_no_sync = False  # every micro-step must reduce-scatter: parameters are released
    norm_skip: frozenset[int] = frozenset()  # TP with ZeRO-3 is refused: nobody else counts

    @classmethod
    def accepts(cls, ctx: StrategyContext) -> bool:
        return ctx.config.zero_optimization.stage == 3

    @classmethod
    def from_context(cls, ctx: StrategyContext) -> Zero3Strategy:
        opt, zero = require_optimizer(ctx), ctx.config.zero_optimization
        two_hop = zero.mics_hierarchical_params_gather
        device, groups = offload_device(ctx.config), ZeroGroups.from_mesh(ctx.mesh, two_hop)
        return cls.from_config(ctx.model, opt, zero, groups.shard, device, groups)

    def checkpoint_layout(
        self, module: nn.Module, optimizer: Optimizer, mesh: ProcessMesh
    ) -> Layout:
        """Parameters, masters and states all flat shards of each unit (a persistent unit:
        one whole shard, replicated over DP); parameters outside the units whole."""
        shards = [
            FlatShard(
                u.layout,
                0 if u.persistent else self.rank,
                u.master,
                not shares_storage(u.master, u.shard),
                u.persistent,
                model=u.shard,
                holders=self.groups.holders,
            )
            for u in self.units
        ]
        return flat_layout(module, mesh, shards)

    def close(self) -> None:
        self.gather_scheduler.remove()

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        group: ProcessGroup | None = None,
        offload_device: torch.device | None = None,
        param_offload_device: torch.device | None = None,
        pin_memory: bool = False,
        persistence_threshold: int = 0,
        model_persistence_threshold: int = 2**62,
        prefetch_elements: int = 50_000_000,
        max_live: int = 1_000_000_000,
        groups: ZeroGroups | None = None,
    ) -> None:
        """``groups``: MiCS (zero/mics.py), ``group`` being its shard group."""
        self.module = module
        self.groups = groups or ZeroGroups.flat(group)
        self.group = group
        self.world = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.offload_device = offload_device
        self.param_offload_device, self.pin_memory = param_offload_device, pin_memory
        self.norm_group = group if self.world > 1 else clip.LOCAL
        self.live = LiveCount()
        self.units: list[Unit] = []
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        own_rng = (
            sync_rng(self.groups.data) if any(p.is_meta for p in module.parameters()) else None
        )
        units_of = self._plan(module, group_of, persistence_threshold, model_persistence_threshold)
        if own_rng is not None:
            torch.set_rng_state(own_rng)
        for u in self.units:
            u.master = self._master(u.shard)
        self.optimizer = rebind_optimizer(optimizer, self.units, group_of)
        self.units_of, self.budgets = units_of, (prefetch_elements, max_live)
        self.gather_scheduler = self._scheduler()
        self.zero_grad()

    def regroup_for_compile(self) -> None:
        """After ``engine.compile()``: each compiled region gathers all its modules' units."""
        self.close()
        self.gather_scheduler = self._scheduler()

    def _scheduler(self) -> GatherScheduler:
        regions = lift_to_regions(self.module, self.units_of)
        return GatherScheduler(self.module, regions, self.units, self.groups.scale, *self.budgets)

    @classmethod
    def from_config(
        cls,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        zero: ZeroConfig,
        group: ProcessGroup | None = None,
        offload_device: torch.device | None = None,
        groups: ZeroGroups | None = None,
    ) -> Zero3Strategy:
        """From the ``zero_optimization`` block (config.zero.ZeroConfig)."""
        param = zero.offload_param
        made = cls(
            module,
            optimizer,
            group=group,
            offload_device=offload_device,
            param_offload_device=torch.device(param.device) if param is not None else None,
            pin_memory=param is not None and param.pin_memory,
            persistence_threshold=zero.stage3_param_persistence_threshold,
            model_persistence_threshold=zero.stage3_model_persistence_threshold,
            prefetch_elements=zero.stage3_prefetch_bucket_size,
            max_live=zero.stage3_max_live_parameters,
            groups=groups,
        )
        return quantize_units(made, group, zero)  # ZeRO++ (zero/quantized_comm.py)

    # ------------------------------------------------------------------ construction
    def _plan(
        self, root: nn.Module, group_of: dict[int, int], threshold: int, budget: int
    ) -> dict[nn.Module, list[Unit]]:
        """Cut the model into units, module by module (so that at most one module's
        parameters are whole at a time when they come partitioned or on the meta device);
        return, for each module, the non-persistent units its forward needs."""
        unit_of: dict[int, Unit] = {}
        persistent: dict[int, nn.Parameter] = {}
        units_of: dict[nn.Module, list[Unit]] = {}
        for module in root.modules():
            materialize_meta(module)
            own = list(module.parameters(recurse=False))
            sharded = []
            for p in own:
                if id(p) in unit_of or id(p) in persistent:
                    continue  # tied: planned with its first module
                if id(p) not in group_of:
                    unpartition(p)  # not trained (frozen): kept whole, as it was given
                elif numel(p) < threshold and numel(p) <= budget:
                    budget -= numel(p)
                    persistent[id(p)] = p
                else:
                    sharded.append(p)
            for params in _split(sharded, group_of):
                u = self._make_unit(params, persistent=False)
                unit_of.update({id(p): u for p in params})
            mine = [unit_of[id(p)] for p in own if id(p) in unit_of]
            if mine:
                units_of[module] = list({id(u): u for u in mine}.values())
        for params in _split(persistent.values(), group_of):
            self._make_unit(params, persistent=True)
        return units_of

    def _make_unit(self, params: list[nn.Parameter], persistent: bool) -> Unit:
        """Lay ``params`` end to end, keep this rank's shard (or all of it if persistent).

        A sharded unit never exists whole on a rank: its shard is filled piece by piece
        from each parameter's overlap with it (``FlatLayout.overlaps``)."""
        shapes = [p.ds_shape if is_partitioned(p) else p.shape for p in params]
        layout = FlatLayout.of(params, 1 if persistent else self.world, shapes)
        dtype, device = params[0].dtype, params[0].device
        if persistent:
            flat = torch.zeros(layout.padded, dtype=dtype, device=device)
            for i, p in enumerate(params):
                layout.view(flat, i).copy_(full_value(p))
            shard = flat
        else:
            shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
            pieces = {i: (start, at, n) for i, start, at, n in layout.overlaps(self.rank)}
            for i, p in enumerate(params):
                value = full_value(p)  # on every rank, in order: a collective when partitioned
                if i in pieces:
                    start, at, n = pieces[i]
                    shard[at : at + n].copy_(value.reshape(-1)[start : start + n])
            shard = self._keep(shard)
        group = self.groups.data if persistent else self.group  # persistent: whole on all N
        u = Unit(layout, shard, persistent, group, self.rank, self.live, device=device)
        if self.groups.nodes > 1:  # MiCS's two-hop gather (zero/mics.py)
            u.gather = self.groups.all_gather
        if self.groups.replicas > 1:  # GatheredParameters' changes reach every replica
            u.data = self.groups.data
        for i, p in enumerate(params):
            for name in ("ds_tensor", "ds_group"):
                if hasattr(p, name):
                    delattr(p, name)
            p.ds_shape, p.ds_numel, p._shardwise_unit = layout.shapes[i], numel(p), u
            p.data = layout.view(shard, i) if persistent else shard.new_empty(0)
        self.units.append(u)
        return u

    def _keep(self, shard: torch.Tensor) -> torch.Tensor:
        """A copy of this rank's shard where it lives between uses: on the compute device, or
        in host memory under offload_param (pinned if asked and an accelerator can use it)."""
        if self.param_offload_device is None:
            return shard
        kept = shard.to(self.param_offload_device, copy=True)
        if self.pin_memory and shard.device.type != "cpu":
            kept = kept.pin_memory()
        return kept

    def _master(self, shard: torch.Tensor) -> nn.Parameter:
        if shard.dtype == torch.float32 and self.offload_device is None:
            return nn.Parameter(shard)  # shares storage: the step writes the shard directly
        device = self.offload_device or shard.device
        return nn.Parameter(shard.detach().to(device, torch.float32, copy=True))

    # ------------------------------------------------------------------ backward
    def before_backward(self, sync: bool) -> None:
        self.sync = sync

    def after_backward(self, sync: bool) -> None:
        """Finish this micro-step's reduce-scatters and release every gathered unit; on the
        boundary, all-reduce the persistent gradients (accumulated whole until then) and,
        under MiCS, each gradient shard over its replicas."""
        self.gather_scheduler.finish_backward()
        if sync:
            for u in self.units:
                if u.persistent:
                    u.allreduce_grads(self.groups.scale)
            self.groups.allreduce([u.grad_shard for u in self.units if not u.persistent])

    # ------------------------------------------------------------------ step
    def owned_grads(self) -> list[torch.Tensor]:
        """Each element of the global gradient once: reduced shards on every rank, the
        replicated persistent gradients on rank 0 only."""
        out = [u.grad_shard for u in self.units if not u.persistent]
        if self.rank == 0:
            out += [u.grad_shard for u in self.units if u.persistent and u.grad_shard is not None]
        return out

    def reduced_grads(self, p: nn.Parameter) -> list[torch.Tensor]:
        """After the reduction: views of the part of ``p``'s gradient this rank's shard holds."""
        u = p._shardwise_unit
        i = next(j for j, q in enumerate(u.layout.params) if q is p)
        if u.grad_shard is None:
            return []
        part = 0 if u.persistent else self.rank
        return [u.grad_shard[at : at + n] for j, _, at, n in u.layout.overlaps(part) if j == i]

    def step(self, optimizer: Optimizer, coef: float) -> None:
        """Step the fp32 master shards with gradients * coef; write them into the parameter
        shards. No communication: the next forward gathers the new values."""
        for u in self.units:
            g = u.grad_shard if u.grad_shard is not None else torch.zeros_like(u.shard)
            u.master.grad = g.to(u.master.device, torch.float32) * coef
        self.optimizer.step()
        with torch.no_grad():
            for u in self.units:
                u.master.grad = None
                if u.master.data_ptr() != u.shard.data_ptr():
                    u.shard.copy_(u.master.detach())

    def zero_grad(self) -> None:
        for u in self.units:
            for p in u.params:
                p.grad = None
            if u.persistent:
                u.grad_shard = None
            else:
                # The shard persists (the ZeRO paper counts it: 2 Psi / N in 16 bits).
                if u.grad_shard is None:  # beside the gradients: on the compute device
                    u.grad_shard = torch.zeros_like(u.shard, device=u.compute_device)
                u.grad_shard.zero_()

    # ------------------------------------------------------------------ state
    def consolidated_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Gather each unit in turn (one whole unit at a time beyond the result) and return
        the module's state dict with its own keys, on CPU, identical on every rank."""
        values: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for u in self.units:
                held = u.full is not None
                u.materialize(exact=True)
                for p in u.params:
                    values[id(p)] = p.detach().cpu().clone()
                if not held:
                    u.release()
        state = module.state_dict(keep_vars=True)
        return {
            k: values[id(v)] if id(v) in values else v.detach().cpu().clone()
            for k, v in state.items()
        }

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors holding this rank's model states, by kind (for memory_breakdown)."""
        opt_state = [
            t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        ]
        masters = [u.master.data for u in self.units if not shares_storage(u.master, u.shard)]
        managed = {id(p) for u in self.units for p in u.params}
        frozen = [p.data for p in self.module.parameters() if id(p) not in managed]
        grads = [u.grad_shard for u in self.units if u.grad_shard is not None]
        grads += [p.grad for u in self.units for p in u.params if p.grad is not None]
        buffers = [t for u in self.units for t in (u.full, u.send, u.out) if t is not None]
        return {
            "params": [u.shard for u in self.units] + frozen,
            "grads": grads,
            "optimizer": masters + opt_state,
            "comm_buffers": buffers,
        }


def lift_to_regions(
    root: nn.Module, units_of: dict[nn.Module, list[Unit]]
) -> dict[nn.Module, list[Unit]]:
    """Units of modules inside a compiled region moved to the region (parallel/compile.py):
    its hooks gather them all before its compiled forward and release them after."""
    regions = region_of(root)
    lifted: dict[nn.Module, list[Unit]] = {}
    for module, mine in units_of.items():
        owner = lifted.setdefault(regions.get(module, module), [])
        owner.extend(u for u in mine if all(u is not v for v in owner))
    return lifted


def _split(params: Iterable[nn.Parameter], group_of: dict[int, int]) -> list[list[nn.Parameter]]:
    """Parameters by (optimizer group, dtype, device), first-seen order kept: one flat buffer
    cannot mix dtypes, and one master tensor belongs to one optimizer group."""
    out: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        out.setdefault((group_of[id(p)], p.dtype, p.device), []).append(p)
    return list(out.values())
