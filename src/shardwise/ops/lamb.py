"""``deepspeed.ops.lamb``: not provided (a fused CUDA kernel), refused with the alternative."""

from shardwise.errors import NotProvidedError

raise NotProvidedError(
    "deepspeed.ops.lamb.FusedLamb",
    'DeepSpeed\'s fused CUDA LAMB kernel; use "optimizer": {"type": "AdamW"} or pass any '
    "torch.optim optimizer to initialize(optimizer=...) (docs/deepspeed-compat.md)",
)
