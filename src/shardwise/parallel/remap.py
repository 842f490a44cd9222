"""User parameter lists collected before a rewrite, mapped onto the rewritten parameters.

A script builds ``model_parameters`` from the model it holds: ``model.parameters()``, or the
Hugging Face Trainer's decay / no-decay groups from ``named_parameters()``. Tensor parallelism
then replaces the split layers, and their parameters, by shards. An optimizer built on the
user's list would step the old, unused tensors and leave the split layers untrained, silently.
So the list is taken apart before the rewrite (:func:`snapshot`: parameter -> name) and put
back together after it (:func:`remap_parameters`: each old parameter -> the parameter now under
its name), keeping every group and its options.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from shardwise.config import ConfigError

KEY = "model_parameters"


def materialize(model_parameters: Iterable | None) -> list | None:
    """A list (a generator can be read once only, and must be read before the rewrite)."""
    if model_parameters is None:
        return None
    return [dict(g) if isinstance(g, Mapping) else g for g in model_parameters]


def snapshot(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in ``model`` (tied parameters have several)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def remap_parameters(params: list, before: dict[int, str], model: nn.Module) -> list:
    """``params`` (tensors, or group dicts whose "params" is a tensor or a list of them) with
    every parameter the rewrite replaced swapped for the one ``model`` now holds under its
    name. Parameters the model still holds, and tensors that never were the model's, are kept.
    A replaced parameter whose name is gone raises ConfigError naming it."""
    now = dict(model.named_parameters(remove_duplicate=False))
    live = {id(p) for p in now.values()}

    def one(p: Any) -> Any:
        if id(p) in live or id(p) not in before:
            return p
        name = before[id(p)]
        if name not in now:
            raise ConfigError(
                f"{KEY}: parameter {name!r} was replaced while the model was prepared "
                "(tensor parallelism) and no parameter of that name exists now; build the "
                "optimizer from the prepared model (optimizer=lambda params: ...)",
                key=KEY,
            )
        return now[name]

    out = []
    for item in params:
        if isinstance(item, Mapping):
            group = dict(item)
            inner = group.get("params")
            if isinstance(inner, nn.Parameter) or not isinstance(inner, Iterable):
                group["params"] = one(inner)
            else:
                group["params"] = [one(p) for p in inner]
            out.append(group)
        else:
            out.append(one(item))
    return out
