"""``deepspeed.runtime.zero``: ZeRO-3's construction names (``shardwise.zero``)."""

from shardwise.runtime.zero import partition_parameters
from shardwise.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "partition_parameters"]
