"""The optimizer a config names, as a plain ``torch.optim`` optimizer.

Type names match case-insensitively, as in DeepSpeed:

- ``Adam``: torch ``AdamW`` (decoupled weight decay), or torch ``Adam`` (L2 weight decay added to
  the gradient) when ``adam_w_mode`` is false: DeepSpeed's ``adam_w_mode`` defaults to true.
- ``AdamW``: torch ``AdamW`` whatever ``adam_w_mode`` says (as in DeepSpeed).
- ``SGD``, ``Adagrad``: the torch classes.
- Any other name: ``torch.optim.<name>`` if it exists (exact, then any case), else an error.
- DeepSpeed's own kernels (Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam, Lion, MuAdam, ...) are
  refused with a clear message when the optimizer is built; the config itself parses.

DeepSpeed-only parameters are consumed: ``torch_adam`` (always torch here), ``adam_w_mode``
(above), ``bias_correction`` (true only: torch's Adam always corrects the bias). Every other
parameter must be an argument of the torch class. ``"auto"`` values: ``betas``, ``eps`` and
``weight_decay`` get the Hugging Face Trainer's defaults (0.9, 0.999), 1e-8 and 0.0; any other
``"auto"`` (``lr`` first of all) is an error asking for a value.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from shardwise.config.errors import ConfigError, did_you_mean, fail, join
from shardwise.config.optim_blocks import OptimizerConfig, check_optimizer_params
from shardwise.config.schema import AUTO

SUPPORTED = {"adam": "AdamW", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad"}
NOT_SUPPORTED = {
    "lamb": "DeepSpeed's fused CUDA LAMB kernel",
    "onebitadam": "DeepSpeed's 1-bit Adam (compressed communication kernels)",
    "onebitlamb": "DeepSpeed's 1-bit LAMB (compressed communication kernels)",
    "zerooneadam": "DeepSpeed's 0/1 Adam (compressed communication kernels)",
    "lion": "DeepSpeed's fused Lion kernel (torch.optim has no Lion)",
    "muadam": "DeepSpeed's MuP optimizers (the mup package)",
    "muadamw": "DeepSpeed's MuP optimizers (the mup package)",
    "musgd": "DeepSpeed's MuP optimizers (the mup package)",
}
AUTO_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_PATH = "optimizer.params"


def build_optimizer(cfg: OptimizerConfig, params: Iterable[Any]) -> Optimizer:
    """``torch.optim`` optimizer for ``cfg`` over ``params`` (tensors or param-group dicts).

    Raises ConfigError naming the key for an unsupported type, an unknown parameter, an
    unresolvable "auto", or a value torch refuses.
    """
    kwargs = _resolve_auto(cfg.params)
    check_optimizer_params(kwargs, _PATH)
    cls, kwargs = _select(cfg.type, kwargs)
    _check_arguments(cls, kwargs)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as error:
        raise fail(_PATH, f"torch.optim.{cls.__name__} refused these parameters: {error}") from None


def optimizer_class(name: str) -> type[Optimizer]:
    """The torch class for a config type name (rules in the module docstring, ``adam_w_mode`` aside)."""
    key = name.lower()
    if key in NOT_SUPPORTED:
        raise fail(
            "optimizer.type",
            f"{name!r} is not supported by shardwise: it is {NOT_SUPPORTED[key]}. "
            "Use Adam, AdamW, SGD, Adagrad or another torch.optim optimizer",
        )
    if key in SUPPORTED:
        return getattr(torch.optim, SUPPORTED[key])
    classes = {n: c for n, c in vars(torch.optim).items() if _is_optimizer(c)}
    if name in classes:
        return classes[name]
    by_lower = {n.lower(): c for n, c in classes.items()}
    if key in by_lower:
        return by_lower[key]
    hint = did_you_mean(name, ["Adam", "AdamW", "SGD", "Adagrad", *classes])
    raise fail(
        "optimizer.type",
        f"unknown optimizer {name!r}{hint or '.'} Supported: Adam, AdamW, SGD, Adagrad, or any "
        f"torch.optim optimizer ({', '.join(sorted(classes))})",
    )


def _is_optimizer(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(obj, Optimizer) and obj is not Optimizer


def _resolve_auto(params: dict[str, Any]) -> dict[str, Any]:
    resolved = dict(params)
    for key, value in params.items():
        if value != AUTO:
            continue
        if key not in AUTO_DEFAULTS:
            raise fail(
                join(_PATH, key),
                '"auto" needs a value: shardwise fills in "auto" only for betas, eps and '
                "weight_decay (the Hugging Face Trainer fills the rest from its arguments); give a "
                f"number, e.g. cfg.with_values({{'{join(_PATH, key)}': 3e-4}})",
            )
        resolved[key] = AUTO_DEFAULTS[key]
    return resolved


def _select(name: str, kwargs: dict[str, Any]) -> tuple[type[Optimizer], dict[str, Any]]:
    """The class, and the kwargs without DeepSpeed's Adam switches."""
    cls = optimizer_class(name)
    if name.lower() not in ("adam", "adamw"):
        return cls, kwargs
    kwargs = dict(kwargs)
    kwargs.pop("torch_adam", None)
    adam_w_mode = kwargs.pop("adam_w_mode", True)
    if kwargs.pop("bias_correction", True) is False:
        raise fail(
            join(_PATH, "bias_correction"),
            "false is not supported: torch's Adam and AdamW always correct the bias of the moment "
            "estimates. Remove the key (or set it to true)",
        )
    if name.lower() == "adam" and adam_w_mode is False:
        return torch.optim.Adam, kwargs
    return cls, kwargs


def _check_arguments(cls: type[Optimizer], kwargs: dict[str, Any]) -> None:
    """Every key must be an argument of the torch constructor; name the closest one if not."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return
    names = set(parameters) - {"self", "params"}
    for key in kwargs:
        if key not in names:
            where = join(_PATH, key)
            raise ConfigError(
                f"unknown key '{where}' for torch.optim.{cls.__name__}{did_you_mean(key, names)}",
                key=where,
            )
