"""Seeding every generator of a process at once (``shardwise.utils`` re-exports it under
DeepSpeed's ``set_random_seed``)."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy and torch in this process."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
