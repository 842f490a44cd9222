"""``deepspeed.runtime.engine``."""

from shardwise.engine import Engine

DeepSpeedEngine = Engine

__all__ = ["DeepSpeedEngine"]
