"""``shardwise.moe``: DeepSpeed's ``deepspeed.moe`` names (``layer.MoE``, ``utils``) for the
mixture-of-experts mechanism in ``shardwise.parallel.moe`` (docs/moe.md)."""

from shardwise.moe import layer, utils

__all__ = ["layer", "utils"]
