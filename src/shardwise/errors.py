"""shardwise's exceptions, in one leaf module that imports nothing of shardwise, so that any
module can raise them without an import cycle. Each message says what to do.

    ConfigError      a config key or an argument is wrong (names the key)      config/errors.py
    EngineError      a call the engine cannot honour in its current state
    CheckpointError  a checkpoint is damaged, incomplete or from another model  checkpoint/manifest.py
    TopologyError    sizes that do not fit the world                            topology.py

and the config warnings (``shardwise.config`` exports them; here so that the LR schedules, which
the config checks its scheduler block against, warn without importing the config):

    ConfigWarning               a key accepted but ignored, deprecated, or an "auto" defaulted
    DeepSpeedDifferenceWarning  a setting run differently from DeepSpeed 0.19, on purpose
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module


class EngineError(RuntimeError):
    """A call the engine cannot honour in its current state; the message says what to do."""


class ConfigWarning(UserWarning):
    """A config key that is accepted but ignored, deprecated, or an ``"auto"`` that fell back to a default."""


class DeepSpeedDifferenceWarning(ConfigWarning):
    """A setting shardwise runs differently from DeepSpeed 0.19, on purpose (docs/config.md says why)."""


class NotProvidedError(ImportError):
    """A DeepSpeed module shardwise does not provide (docs/deepspeed-compat.md): the message says
    what to use instead. An ImportError, so ``try: from deepspeed.X import Y except ImportError``
    probes work; its package turns it into an AttributeError with the same message for
    ``deepspeed.X.Y`` (so ``hasattr`` is False)."""

    def __init__(self, name: str, instead: str) -> None:
        super().__init__(f"{name} is not provided by shardwise: {instead}")
        self.name = name


def refuse_missing(package: str, refused: tuple[str, ...]) -> Callable[[str], object]:
    """A package's ``__getattr__``: ``deepspeed.<package>.<name>`` for a refused module name
    imports it, whose NotProvidedError comes back as an AttributeError with its message (so
    ``hasattr`` is false); any other missing name is the usual AttributeError."""

    def __getattr__(name: str) -> object:
        if name in refused:
            try:
                import_module(f"{package}.{name}")  # raises NotProvidedError, naming what to use
            except NotProvidedError as e:
                raise AttributeError(str(e)) from e
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
