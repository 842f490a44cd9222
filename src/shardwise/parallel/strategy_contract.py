"""The gradient-strategy contract: what the engine, the pipeline, checkpoints and the memory
accounting may ask of the object that owns gradients and the update.

One training step, for any strategy S, with g the model's gradient and GAS micro-batches:

    for each micro-batch:  S.before_backward(sync); (loss / GAS).backward(); S.after_backward(sync)
                           sync is True on the accumulation boundary (reduce then), else False
    on the boundary:       norm = sqrt(sum over ranks of ||t||^2 for t in S.owned_grads()),
                           summed over S.norm_group (clip.LOCAL: already global)
                           S.step(optimizer, coef)   (gradients times coef = clip / loss scale)
                           S.zero_grad()

``owned_grads`` holds every element of the global gradient exactly once across the ranks that
the norm sums over (a data-parallel replica counts once, a ZeRO shard on its owner, a
tensor-parallel-replicated parameter on TP rank 0: ``norm_skip``, given at construction).

Strategies (a table, ``STRATEGIES``, picks one from the config, first that ``accepts``):

    LocalGradients        one data rank, fp32: the user's optimizer, gradients untouched
    DataParallelReducer   fp32 stage 0: bucketed all-reduce overlapped with backward
    ZeroStrategy          stages 1-2 and 16-bit stage 0: fp32 master shards, reduce-scatter
    Zero3Strategy         stage 3: parameters sharded too, gathered around each use

A new ZeRO-like strategy is a class with these members, one line in ``STRATEGIES``, and a
``checkpoint_layout`` built from checkpoint/rank_pieces.py's public helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from shardwise.config.errors import ConfigError
from shardwise.precision import compute_dtype

if TYPE_CHECKING:  # annotations only
    from shardwise.checkpoint.rank_pieces import Layout
    from shardwise.config import Config
    from shardwise.topology import ProcessMesh


@dataclass
class StrategyContext:
    """Everything a strategy is built from: the config, the prepared model (every module
    rewrite done), the optimizer over its parameters, the mesh, the parameters that need a
    bucket of their own (tied across pipeline stages) and those another rank counts in the norm."""

    config: Config
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    mesh: ProcessMesh
    isolate: Sequence[nn.Parameter] = ()
    norm_skip: frozenset[int] = field(default_factory=frozenset)


@runtime_checkable
class GradientStrategy(Protocol):
    """The members every strategy provides (module docstring for the step they make)."""

    norm_group: Any  # the group owned_grads' squares are summed over; clip.LOCAL: none
    norm_skip: frozenset[int]  # ids of parameters another rank counts in the norm
    supports_no_sync: bool  # False: every micro-step must reduce (gradients are partitioned)
    # The optimizer the engine exposes and steps when the strategy pointed the user's at its
    # master shards (ZeRO; the same object); None: the user's optimizer steps the parameters.
    optimizer: torch.optim.Optimizer | None

    @classmethod
    def accepts(cls, ctx: StrategyContext) -> bool:
        """This strategy runs the configuration ``ctx`` describes."""

    @classmethod
    def from_context(cls, ctx: StrategyContext) -> GradientStrategy:
        """The strategy for ``ctx`` (refusing, naming the key, what it cannot run)."""

    def before_backward(self, sync: bool) -> None:
        """Before a micro-batch's backward; ``sync``: it ends the accumulation."""

    def after_backward(self, sync: bool) -> None:
        """After it: finish the reductions this micro-step owes (all of them when ``sync``)."""

    def owned_grads(self) -> list[torch.Tensor]:
        """The pieces of the reduced gradient whose squares sum to this rank's norm share."""

    def reduced_grads(self, p: nn.Parameter) -> list[torch.Tensor]:
        """Views of the part of ``p``'s reduced gradient this rank holds (tied-weight sums)."""

    def step(self, optimizer: torch.optim.Optimizer | None, coef: float) -> None:
        """The update with gradients times ``coef``; afterwards every rank holds its weights."""

    def zero_grad(self) -> None:
        """Drop the gradients of the step just taken."""

    def consolidated_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The module's whole state dict on CPU, identical on every rank of the data group."""

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors holding this rank's model states by kind (params, grads, optimizer,
        comm_buffers); kinds left out are counted from the module and the optimizer."""

    def checkpoint_layout(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None, mesh: ProcessMesh
    ) -> Layout:
        """What this rank holds, as checkpoint pieces and optimizer slots (checkpoint/rank_pieces.py)."""

    def close(self) -> None:
        """Remove every hook this strategy put on the parameters (the engine is done)."""


DEFAULT_BUCKET_ELEMENTS = 2**22  # DeepSpeed's reduce_bucket_size default (5e8) is for GPUs


def bucket_elements(cfg: Config) -> int:
    """Elements per communication bucket: ``zero_optimization.reduce_bucket_size`` when the
    config gives it, else 4 Mi elements (small enough to overlap on a CPU)."""
    if "reduce_bucket_size" in cfg.raw.get("zero_optimization", {}):
        return int(cfg.zero_optimization.reduce_bucket_size) or DEFAULT_BUCKET_ELEMENTS
    return DEFAULT_BUCKET_ELEMENTS


def offload_device(cfg: Config) -> torch.device | None:
    """Where ``offload_optimizer`` puts the master weights and optimizer states (None: stay)."""
    offload = cfg.zero_optimization.offload_optimizer
    return torch.device(offload.device) if offload is not None else None


def plain_precision(ctx: StrategyContext) -> bool:
    """Stage 0 in fp32 without offload: the user's optimizer can step the parameters."""
    cfg = ctx.config
    fp32 = compute_dtype(cfg) == torch.float32
    return cfg.zero_optimization.stage == 0 and fp32 and offload_device(cfg) is None


def require_optimizer(ctx: StrategyContext) -> torch.optim.Optimizer:
    """The optimizer a strategy with master weights steps them with, or the error naming the key."""
    if ctx.optimizer is None:
        stage = ctx.config.zero_optimization.stage
        raise ConfigError(
            f"zero_optimization.stage={stage} and 16-bit training keep the master weights "
            'in the optimizer: give an "optimizer" block or pass optimizer= to initialize',
            key="optimizer",
        )
    return ctx.optimizer
