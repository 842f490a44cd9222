"""The optimizer a config names, as a plain ``torch.optim`` optimizer.

Type names match case-insensitively, as in DeepSpeed:

- ``Adam``: DeepSpeed's FusedAdam: decoupled weight decay (``adam_w_mode`` defaults to true),
  or L2 weight decay added to the gradient when ``adam_w_mode`` is false, with FusedAdam's
  defaults (``weight_decay`` 0, not torch AdamW's 0.01). Built as torch ``AdamW`` / ``Adam`` (the
  same update) unless ``bias_correction`` is false, then as ``FusedAdam`` (adam.py).
  ``torch_adam: true`` takes torch's class with torch's own defaults, as DeepSpeed does.
- ``AdamW``: the same, decoupled whatever ``adam_w_mode`` says (as in DeepSpeed).
- ``SGD``, ``Adagrad``: the torch classes.
- Any other name: ``torch.optim.<name>`` if it exists (exact, then any case), else an error.
- DeepSpeed's own kernels (Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam, Lion, MuAdam, ...) are
  refused with a clear message when the optimizer is built; the config itself parses.

DeepSpeed-only parameters are consumed: ``torch_adam``, ``adam_w_mode`` and ``bias_correction``
(above); ``amsgrad`` is refused without ``torch_adam``, as FusedAdam refuses it. Every other
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
from shardwise.optim.adam import DeepSpeedCPUAdam, FusedAdam

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
# DeepSpeed's FusedAdam / DeepSpeedCPUAdam constructor defaults (deepspeed/ops/adam).
FUSED_ADAM_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "bias_correction": True,
    "adam_w_mode": True,
}
_PATH = "optimizer.params"


def build_optimizer(
    cfg: OptimizerConfig, params: Iterable[Any], cpu_adam: bool = False
) -> Optimizer:
    """``torch.optim`` optimizer for ``cfg`` over ``params`` (tensors or param-group dicts).
    ``cpu_adam``: "Adam"/"AdamW" (without ``torch_adam``) build ``DeepSpeedCPUAdam``, as
    DeepSpeed does under ZeRO-Offload (its fp32 states serve fp16 master weights).

    Raises ConfigError naming the key for an unsupported type, an unknown parameter, an
    unresolvable "auto", or a value torch refuses.
    """
    kwargs = _resolve_auto(cfg.params)
    check_optimizer_params(kwargs, _PATH)
    cls, kwargs = _select(cfg.type, kwargs, cpu_adam)
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


def _is_optimizer(obj: object) -> bool:
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


def _select(
    name: str, kwargs: dict[str, Any], cpu_adam: bool = False
) -> tuple[type[Optimizer], dict[str, Any]]:
    """The class, and the kwargs without DeepSpeed's Adam switches (DeepSpeed's rules, see
    ``_configure_basic_optimizer``: "AdamW", or "Adam" with ``adam_w_mode`` (default true), is
    decoupled; ``torch_adam`` takes torch's class with torch's defaults, else FusedAdam's)."""
    cls = optimizer_class(name)
    if name.lower() not in ("adam", "adamw"):
        return cls, kwargs
    kwargs = dict(kwargs)
    torch_adam = kwargs.pop("torch_adam", False)
    decoupled = name.lower() == "adamw" or kwargs.pop("adam_w_mode", True)
    kwargs.pop("adam_w_mode", None)
    bias_correction = kwargs.pop("bias_correction", True)
    if torch_adam:
        if bias_correction is False:
            raise fail(
                join(_PATH, "bias_correction"),
                "false needs DeepSpeed's own Adam: torch's Adam and AdamW (torch_adam: true) "
                "always correct the bias. Remove torch_adam or bias_correction",
            )
        return (torch.optim.AdamW if decoupled else torch.optim.Adam), kwargs
    if kwargs.get("amsgrad"):
        raise fail(join(_PATH, "amsgrad"), "FusedAdam does not support AMSGrad (as in DeepSpeed)")
    kwargs.pop("amsgrad", None)
    kwargs.setdefault("weight_decay", FUSED_ADAM_DEFAULTS["weight_decay"])  # torch's AdamW: 0.01
    if cpu_adam:
        return DeepSpeedCPUAdam, {
            **kwargs,
            "bias_correction": bias_correction,
            "adamw_mode": decoupled,
        }
    if bias_correction is False:
        return FusedAdam, {**kwargs, "bias_correction": False, "adam_w_mode": decoupled}
    # The same update as FusedAdam's (bias corrected), from torch's tested kernels.
    return (torch.optim.AdamW if decoupled else torch.optim.Adam), kwargs


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
