"""``deepspeed.accelerator.real_accelerator``: the process's accelerator
(``shardwise.devices.current``)."""

from shardwise.devices.current import get_accelerator, set_accelerator

__all__ = ["get_accelerator", "set_accelerator"]
