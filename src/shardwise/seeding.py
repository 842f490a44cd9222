"""Seeding every generator of a process at once (``shardwise.utils`` re-exports it under
DeepSpeed's ``set_random_seed``)."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy and torch in this process, as DeepSpeed does: NumPy takes
    ``seed mod 2**32`` and torch ``seed mod 2**63`` (the widths they accept), so any int works,
    pytest-randomly's seeds beyond 2**64 included."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)
