"""DeepSpeed's ``deepspeed.ops`` optimizers, written for any device (``shardwise.ops.adam``)."""
