"""Typed, validated DeepSpeed-style configs.

>>> cfg = parse_config({"train_batch_size": 32, "zero_optimization": {"stage": 2}})
>>> cfg.resolve_batch(dp_world_size=4)
BatchSizes(train_batch_size=32, micro_batch_size=8, gradient_accumulation_steps=1)

Modules: ``core`` (Config, parse_config), ``batch`` (batch arithmetic), ``schema`` (type rules),
``zero`` / ``precision`` / ``parallel`` / ``optim_blocks`` / ``checkpoint`` / ``comms`` (the blocks), ``keys`` (ignored and
unsupported top-level keys), ``loader`` (files, duplicate keys), ``errors``.
"""

from shardwise.config.batch import BatchSizes
from shardwise.config.checkpoint import CheckpointConfig, ParallelWriteConfig
from shardwise.config.comms import CommsConfig
from shardwise.config.compile import CompileConfig
from shardwise.config.core import Config, parse_config
from shardwise.config.errors import ConfigError
from shardwise.config.optim_blocks import OptimizerConfig, SchedulerConfig
from shardwise.config.parallel import (
    ActivationCheckpointingConfig,
    ContextParallelConfig,
    PipelineConfig,
    TensorParallelConfig,
)
from shardwise.config.precision import BF16Config, FP16Config
from shardwise.config.zero import (
    OffloadConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    ZeroConfig,
)
from shardwise.errors import ConfigWarning, DeepSpeedDifferenceWarning

__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "BatchSizes",
    "CheckpointConfig",
    "CommsConfig",
    "CompileConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "FP16Config",
    "OffloadConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ParallelWriteConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "TensorParallelConfig",
    "ContextParallelConfig",
    "DeepSpeedDifferenceWarning",
    "ZeroConfig",
    "parse_config",
]
