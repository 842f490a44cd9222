"""``deepspeed.runtime.utils``: seeding and the memory report scripts print."""

from __future__ import annotations

import logging

from shardwise import comm
from shardwise.accelerator import get_accelerator
from shardwise.utils import set_random_seed

__all__ = ["see_memory_usage", "set_random_seed"]

logger = logging.getLogger("shardwise")


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` with the accelerator's allocated and peak memory, on rank 0 (DeepSpeed
    prints only when ``force`` is true; so does this)."""
    if not force or comm.get_rank() != 0:
        return
    acc = get_accelerator()
    gib = 2**30
    logger.info(
        "%s | MA %.2f GB | Max_MA %.2f GB | total %.2f GB",
        message,
        acc.memory_allocated() / gib,
        acc.max_memory_allocated() / gib,
        acc.total_memory() / gib,
    )
