"""``deepspeed.runtime.dataloader``."""

from shardwise.data import RepeatingLoader

__all__ = ["RepeatingLoader"]
