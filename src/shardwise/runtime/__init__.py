"""DeepSpeed's ``deepspeed.runtime`` paths that scripts import, as thin aliases.

Nothing here does work: each module re-exports what lives elsewhere in shardwise, so that
``from deepspeed.runtime.X import Y`` ports by the import alone (docs/deepspeed-compat.md).
"""

from shardwise.runtime import config, dataloader, engine, lr_schedules, pipe, utils, zero

__all__ = ["config", "dataloader", "engine", "lr_schedules", "pipe", "utils", "zero"]
