"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` (``shardwise.optim.adam``, where
the update is written out)."""

from shardwise.optim.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
