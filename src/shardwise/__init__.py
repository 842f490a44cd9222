"""shardwise: train a PyTorch model on many processes as simply as on one.

The public surface follows DeepSpeed's, so that ``import shardwise as deepspeed`` runs common
DeepSpeed scripts: ``initialize``, ``init_distributed``, ``add_config_arguments``, ``comm``, and
the deeper paths scripts import (``accelerator``, ``runtime.*``, ``ops.adam``, ``utils``, ``zero``, ``moe``,
``pipe``; docs/deepspeed-compat.md). Model code that may run under context parallelism calls
``shardwise.attention`` and ``shardwise.context_positions`` (docs/context-parallel.md).
"""

from shardwise import accelerator, checkpointing, comm, moe, ops, pipe, runtime, utils, zero
from shardwise.config import ConfigError
from shardwise.config.deepspeed_view import DeepSpeedConfig
from shardwise.launch.env import init_distributed
from shardwise.parallel.context.scope import attention, context_positions
from shardwise.pipe import PipelineModule
from shardwise.spawn import spawn
from shardwise.topology import ProcessMesh, Topology, new_subgroup
from shardwise.training.engine import Engine, EngineError
from shardwise.training.initialize import add_config_arguments, initialize
from shardwise.version import __version__  # noqa: E402 - from the package metadata

# DeepSpeed's spellings, for scripts ported by changing the import only.
DeepSpeedEngine = Engine
DeepSpeedConfigError = ConfigError


__all__ = [
    "ConfigError",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "Engine",
    "EngineError",
    "PipelineModule",
    "ProcessMesh",
    "Topology",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "attention",
    "checkpointing",
    "comm",
    "context_positions",
    "init_distributed",
    "initialize",
    "moe",
    "new_subgroup",
    "ops",
    "pipe",
    "runtime",
    "spawn",
    "utils",
    "zero",
]
