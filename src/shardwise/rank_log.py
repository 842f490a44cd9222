"""Logging from chosen ranks: ``log_dist`` (DeepSpeed's name; ``shardwise.utils`` re-exports it)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from shardwise import comm

logger = logging.getLogger("shardwise")


def log_dist(message: str, ranks: Iterable[int] | None = (0,), level: int = logging.INFO) -> None:
    """Log ``message`` on the given global ranks only (``None`` or ``[-1]``: every rank)."""
    rank = comm.get_rank()
    ranks = list(ranks) if ranks is not None else [-1]
    if -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)
