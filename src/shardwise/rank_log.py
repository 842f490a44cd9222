"""Logging from chosen ranks: ``log_dist`` (DeepSpeed's name; ``shardwise.utils`` re-exports it)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch.distributed as dist

logger = logging.getLogger("shardwise")


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``[Rank r] message`` where DeepSpeed's ``log_dist`` does: on every process when
    torch.distributed is not initialized (``r`` is then -1); otherwise on the ranks listed,
    every rank when the list starts with -1, and nowhere when ``ranks`` is None or empty."""
    if not dist.is_initialized():
        logger.log(level, "[Rank -1] %s", message)
        return
    rank = dist.get_rank()
    if ranks and (ranks[0] == -1 or rank in ranks):
        logger.log(level, "[Rank %d] %s", rank, message)
