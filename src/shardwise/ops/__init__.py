"""DeepSpeed's ``deepspeed.ops`` optimizers, written for any device (``shardwise.ops.adam``)."""

from shardwise.errors import refuse_missing
from shardwise.ops import adam

__all__ = ["adam"]
__getattr__ = refuse_missing(__name__, ("lamb",))  # ops/lamb.py says why
