"""``deepspeed.runtime.lr_schedules``."""

from shardwise.lr_formulas import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
