"""The table from a configuration to its gradient strategy (strategy_contract.py states the contract).

The first class whose ``accepts(ctx)`` holds is built with ``from_context(ctx)``; the order
makes the choice: one data rank in plain fp32 needs no reduction at all, several need the
bucketed all-reduce, stage 3 shards parameters (with hpZ's secondary shards when asked),
and every other case (stages 1-2, 16-bit or offloaded stage 0) keeps fp32 master shards.
"""

from __future__ import annotations

from shardwise.config.errors import ConfigError
from shardwise.parallel.data.reducer import DataParallelReducer, LocalGradients
from shardwise.parallel.data.replica_groups import has_replicas
from shardwise.parallel.strategy_contract import GradientStrategy, StrategyContext
from shardwise.parallel.zero.hpz import HpzStrategy
from shardwise.parallel.zero.stage3 import Zero3Strategy
from shardwise.parallel.zero.stage12 import ZeroStrategy

STRATEGIES: tuple[type, ...] = (
    LocalGradients,
    DataParallelReducer,
    HpzStrategy,  # stage 3 with zero_hpz_partition_size > 1: before Zero3Strategy
    Zero3Strategy,
    ZeroStrategy,
)


def build_strategy(ctx: StrategyContext) -> GradientStrategy:
    """The first strategy of ``STRATEGIES`` that accepts ``ctx``, built from it."""
    stage = ctx.config.zero_optimization.stage
    if stage != 3 and any(p.is_meta or hasattr(p, "ds_tensor") for p in ctx.model.parameters()):
        raise ConfigError(
            f"zero_optimization.stage={stage}: the model was built under "
            "shardwise.parallel.zero.partition.Init() or on the meta device, and only ZeRO stage 3 trains it "
            'without whole parameters: set "stage": 3',
            key="zero_optimization.stage",
        )
    if stage == 3 and any(has_replicas(p) for p in ctx.model.parameters()):
        raise ConfigError(
            "zero_optimization.stage=3 does not shard mixture-of-experts layers over several "
            "data ranks yet (any ep_size): use stage 1 or 2 (experts are sharded over their "
            "expert-data group)",
            key="zero_optimization.stage",
        )
    shard = ctx.config.zero_optimization.mics_shard_size
    if ctx.mesh.topology.zero_shard and any(has_replicas(p) for p in ctx.model.parameters()):
        raise ConfigError(
            f"zero_optimization.mics_shard_size={shard} does not shard mixture-of-experts "
            "layers yet (their experts have expert-data groups of their own): remove the key",
            key="zero_optimization.mics_shard_size",
        )
    for cls in STRATEGIES:
        if cls.accepts(ctx):
            return cls.from_context(ctx)
    raise AssertionError("ZeroStrategy accepts every configuration")  # the table ends with it
