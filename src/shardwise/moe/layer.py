"""``deepspeed.moe.layer``: the ``MoE`` layer (shardwise.parallel.moe.layer)."""

from shardwise.parallel.moe.layer import MoE

__all__ = ["MoE"]
