"""``deepspeed.utils.zero_to_fp32``: not provided, refused naming what does the same."""

from shardwise.errors import NotProvidedError

raise NotProvidedError(
    "deepspeed.utils.zero_to_fp32",
    "shardwise checkpoints are consolidated by `shardwise export CHECKPOINT OUT.safetensors "
    "--fp32` (or shardwise.checkpoint.export.export_consolidated(path, out, dtype='fp32')), "
    "from any layout (docs/checkpoint-format.md)",
)
