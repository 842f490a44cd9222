"""``shardwise.zero``: DeepSpeed's ``deepspeed.zero`` names for ZeRO-3 construction.

``Init`` builds a model already partitioned over the data ranks; ``GatheredParameters`` shows
(and lets one rank change) whole parameters of a partitioned model. The mechanism, and the
math of how a parameter is cut, live in ``shardwise.parallel.zero.partition``; this module only
gives them the names DeepSpeed scripts import.
"""

from shardwise.parallel.zero.partition import GatheredParameters, Init, full_value, is_partitioned

__all__ = ["GatheredParameters", "Init", "full_value", "is_partitioned"]
