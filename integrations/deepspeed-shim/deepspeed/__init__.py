"""DeepSpeed's import name, answered by shardwise: this is not DeepSpeed.

``import deepspeed`` gives shardwise's DeepSpeed-compatible surface (``initialize``,
``init_distributed``, ``comm``, ``zero``, ``utils``, ``runtime``, ``accelerator``, ...;
docs/deepspeed-compat.md), and ``import deepspeed.X`` gives ``shardwise.X``: a finder on
``sys.meta_path`` maps every ``deepspeed.`` module name to the shardwise module of the same
path, so the objects are shardwise's own (``deepspeed.zero.Init is shardwise.zero.Init``).
``deepspeed.__version__`` is this distribution's (``0.19.8+shardwise``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types

try:
    import shardwise
except ImportError as e:  # the shim without the library it stands for
    raise ImportError(
        "this `deepspeed` is shardwise's shim (integrations/deepspeed-shim): install shardwise "
        "too (pip install -e <the shardwise repository>)"
    ) from e

from shardwise import *  # noqa: E402, F403 - DeepSpeed's top-level names

SHARDWISE_SHIM = True
__version__ = importlib.metadata.version("deepspeed")


class _ShardwiseModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``deepspeed.a.b`` -> the module ``shardwise.a.b``, the same object."""

    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith(f"{__name__}."):
            return None
        real = "shardwise." + name.split(".", 1)[1]
        try:
            if importlib.util.find_spec(real) is None:
                return None
        except ModuleNotFoundError:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module("shardwise." + spec.name.split(".", 1)[1])

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing: the shardwise module is already executed."""


if not any(isinstance(f, _ShardwiseModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _ShardwiseModules())
del shardwise
