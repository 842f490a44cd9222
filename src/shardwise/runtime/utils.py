"""``deepspeed.runtime.utils``: seeding (``shardwise.seeding``) and the memory report scripts print
(``shardwise.devices.memory_report``)."""

from shardwise.devices.memory_report import see_memory_usage
from shardwise.seeding import set_random_seed

__all__ = ["see_memory_usage", "set_random_seed"]
