"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` (``shardwise.config.deepspeed_view``)."""

from shardwise.config import ConfigError as DeepSpeedConfigError
from shardwise.config.deepspeed_view import DeepSpeedConfig

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]
