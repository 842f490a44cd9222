"""``deepspeed.runtime.engine``."""

from shardwise.training.engine import Engine

DeepSpeedEngine = Engine

__all__ = ["DeepSpeedEngine"]
