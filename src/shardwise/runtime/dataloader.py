"""``deepspeed.runtime.dataloader``."""

from shardwise.training.data_loader import RepeatingLoader

__all__ = ["RepeatingLoader"]
