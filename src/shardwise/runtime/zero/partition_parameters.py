"""``deepspeed.runtime.zero.partition_parameters``: what ZeRO-3 users import from it."""

from shardwise.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
