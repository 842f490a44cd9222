"""DeepSpeed's ``deepspeed.ops`` optimizers: ``adam`` (written for any device in
``shardwise.optim.adam``); ``lamb`` refused (ops/lamb.py says why)."""

from shardwise.errors import refuse_missing
from shardwise.ops import adam

__all__ = ["adam"]
__getattr__ = refuse_missing(__name__, ("lamb",))  # ops/lamb.py says why
