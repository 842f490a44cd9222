"""``shardwise.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` surface.

``checkpoint(f, *args)`` recomputes ``f`` in backward instead of keeping its activations;
``configure`` takes DeepSpeed's options; the RNG tracker calls serve Megatron-style models. The
mechanism (and the memory arithmetic) lives in ``shardwise.parallel.activation.recompute``; this
module only gives it the names DeepSpeed scripts import.
"""

from shardwise.parallel.activation.recompute import (
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    reset,
)

__all__ = [
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "reset",
]
