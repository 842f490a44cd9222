"""The collective timeout the world was set up with, read back from torch (``new_group`` gives
it to every sub-group; the watchdog and the interposed collectives use it too)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def world_timeout() -> datetime.timedelta | None:
    """The collective timeout the world group was created with (``init_distributed(timeout=)``,
    ``$SHARDWISE_TIMEOUT_S``), or None when torch does not say."""
    try:
        default = dist.distributed_c10d._get_default_group()
        backend = default._get_backend(
            torch.device("cpu" if dist.get_backend() == "gloo" else "cuda")
        )
        return backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
