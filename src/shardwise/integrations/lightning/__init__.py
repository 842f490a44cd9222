"""Lightning (the ``lightning`` package, 2.x) on shardwise: ``ShardwiseStrategy`` (docs/lightning.md).

    from shardwise.integrations.lightning import ShardwiseStrategy
    trainer = Trainer(strategy=ShardwiseStrategy(config={"zero_optimization": {"stage": 2}}),
                      accelerator="cpu", devices=2)

Importing this module registers the strategy with Lightning under ``"shardwise"`` (data
parallelism, or ``ShardwiseStrategy``'s config) and ``"shardwise_zero1"`` .. ``"shardwise_zero3"``,
so ``Trainer(strategy="shardwise_zero3")`` works too. An optional extra: ``pip install
shardwise[lightning]``; nothing else in shardwise imports it.
"""

from __future__ import annotations

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as e:  # the optional extra is missing
    raise ImportError(
        "shardwise.integrations.lightning needs the lightning package: "
        "pip install shardwise[lightning]"
    ) from e

from shardwise.integrations.lightning.precision import ShardwisePrecision
from shardwise.integrations.lightning.strategy import ShardwiseStrategy

ShardwiseStrategy.register_strategies(StrategyRegistry)

__all__ = ["ShardwisePrecision", "ShardwiseStrategy"]
