"""Small helpers DeepSpeed scripts import from ``deepspeed.utils``."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable

import numpy as np
import torch

from shardwise import comm
from shardwise.data import RepeatingLoader

logger = logging.getLogger("shardwise")


def log_dist(message: str, ranks: Iterable[int] | None = (0,), level: int = logging.INFO) -> None:
    """Log ``message`` on the given global ranks only (``None`` or ``[-1]``: every rank)."""
    rank = comm.get_rank()
    ranks = list(ranks) if ranks is not None else [-1]
    if -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %d] %s", rank, message)


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy and torch in this process."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def __getattr__(name: str) -> object:
    # RepeatingLoader lives with the data loaders; imported lazily to keep this module light.
    if name == "RepeatingLoader":
        return RepeatingLoader
    raise AttributeError(name)
