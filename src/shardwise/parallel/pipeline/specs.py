"""``LayerSpec`` and ``TiedLayerSpec``: layers described, to be built on the stage that owns them,
and the small helpers that look at a layer without building it for real."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


class LayerSpec:
    """A layer to build later, on the stage that owns it: ``typename(*args, **kwargs)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise RuntimeError(
                f"LayerSpec only supports torch.nn.Module types, got {typename!r}; put a plain "
                "function in the layer list directly instead"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every TiedLayerSpec with the same ``key``.

    ``forward_fn(module, x)`` replaces ``module(x)`` (an input embedding reused as the output
    projection: ``lambda emb, h: h @ emb.weight.t()``). ``tied_weight_attr``: the parameter
    names (dotted paths are fine) kept identical on every stage that holds the key."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = str(key)
        self.forward_fn = forward_fn
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else tied_weight_attr
        self.tied_weight_attr = list(attrs)


def class_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def count_params(layer: Any) -> int:
    """Trainable parameters of a layer, a spec built on the meta device (no memory, no
    random numbers drawn; a layer that cannot build there is built for real, RNG restored)."""
    if isinstance(layer, nn.Module):
        return trainable(layer)
    if not isinstance(layer, LayerSpec):
        return 0
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                return trainable(layer.build())
        except Exception:  # noqa: BLE001 - a layer that needs real tensors to initialize
            return trainable(layer.build())


def get_attr(module: nn.Module, dotted: str) -> torch.nn.Parameter:
    target: Any = module
    for name in dotted.split("."):
        target = getattr(target, name)
    if not isinstance(target, torch.nn.Parameter):
        raise TypeError(f"tied_weight_attr {dotted!r} of {type(module).__name__} is no parameter")
    return target


def check_layer_names(names: Sequence[str] | None, n: int) -> list[str] | None:
    """``layer_names``: one distinct dotted module name per layer (or None: the indices)."""
    if names is None:
        return None
    names = list(names)
    if len(names) != n or len(set(names)) != n:
        raise ValueError(f"layer_names: give {n} distinct names, one per layer; got {names}")
    prefixes = {".".join(x.split(".")[:k]) for x in names for k in range(1, x.count(".") + 1)}
    clash = sorted(prefixes & set(names))
    if clash:
        raise ValueError(f"layer_names: {clash} name a layer and the parent of another")
    return names


def add_module_names(
    names: list[str] | None, prefix: str, spec: Any, module: nn.Module | None
) -> list[str] | None:
    """``names`` plus a layer's module names under ``prefix`` (its name on its stage); None
    once a layer is unknown here (a LayerSpec another stage builds alone, a tied module)."""
    if names is None or isinstance(spec, TiedLayerSpec):
        return None
    if isinstance(spec, LayerSpec) and module is None:
        return None
    if module is None:
        return names  # a plain callable: no modules
    return names + [f"{prefix}.{n}" if n else prefix for n, _ in module.named_modules()]
