"""DeepSpeed's ``deepspeed.ops`` optimizers, written for any device (``shardwise.ops.adam``)."""

from shardwise.ops import adam

__all__ = ["adam"]
