"""``deepspeed.runtime.lr_schedules``."""

from shardwise.lr_formulas import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

# DeepSpeed's list of its schedule names: Accelerate tells a DeepSpeed schedule from a torch one
# by ``type(scheduler).__name__ in VALID_LR_SCHEDULES``.
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

__all__ = [
    "VALID_LR_SCHEDULES",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
