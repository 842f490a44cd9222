"""DeepSpeed's ``deepspeed.ops`` optimizers, written for any device (``shardwise.ops.adam``)."""

from importlib import import_module

from shardwise.errors import NotProvidedError
from shardwise.ops import adam

__all__ = ["adam"]


def __getattr__(name: str) -> object:
    """``deepspeed.ops.lamb`` without its import meets the module's refusal too."""
    if name == "lamb":
        try:
            import_module(f"{__name__}.{name}")  # raises NotProvidedError, naming what to use
        except NotProvidedError as e:
            raise AttributeError(str(e)) from e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
