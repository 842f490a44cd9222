"""``deepspeed.moe.utils``: expert parameters for optimizers (shardwise.parallel.moe.experts)."""

from shardwise.parallel.moe.experts import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
