"""Small helpers DeepSpeed scripts import from ``deepspeed.utils`` (each lives where it works:
rank_log.py, seeding.py, repeating.py), and ``groups`` (mesh_groups.py)."""

from __future__ import annotations

from importlib import import_module

from shardwise.errors import NotProvidedError
from shardwise.rank_log import log_dist, logger
from shardwise.repeating import RepeatingLoader
from shardwise.seeding import set_random_seed
from shardwise.utils import groups

__all__ = ["RepeatingLoader", "groups", "log_dist", "logger", "set_random_seed"]


def __getattr__(name: str) -> object:
    """``deepspeed.utils.zero_to_fp32`` without its import meets the module's refusal too."""
    if name == "zero_to_fp32":
        try:
            import_module(f"{__name__}.{name}")  # raises NotProvidedError, naming what to use
        except NotProvidedError as e:
            raise AttributeError(str(e)) from e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
