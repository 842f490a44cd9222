"""The ``optimizer`` and ``scheduler`` blocks: checked at parse time, built by optim / lr_schedules.

What is checked here (before any model exists): the optimizer block's shape,
``optimizer.params.lr > 0``, no ``max_grad_norm`` (clipping is the top-level
``gradient_clipping``), the types and ranges of the common optimizer parameters. The scheduler
block is parsed and checked in scheduler_params.py, against the schedules themselves.
``"auto"`` values stay in ``params`` untouched: they are resolved (or refused) when the optimizer
and scheduler are built, see docs/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardwise.config.errors import ConfigError, Notes, fail, join, show
from shardwise.config.schema import AUTO, build, check_bounds, convert

# Common optimizer parameters: name -> (type, bounds). Others are checked against the torch
# optimizer's signature when it is built.
_PARAM_TYPES: dict[str, tuple[Any, dict[str, float]]] = {
    "lr": (float, {"gt": 0}),
    "betas": (tuple[float, float], {}),
    "eps": (float, {"ge": 0}),
    "weight_decay": (float, {"ge": 0}),
    "momentum": (float, {"ge": 0}),
    "dampening": (float, {}),
    "nesterov": (bool, {}),
    "amsgrad": (bool, {}),
    "torch_adam": (bool, {}),
    "adam_w_mode": (bool, {}),
    "bias_correction": (bool, {}),
}


@dataclass(frozen=True)
class OptimizerConfig:
    """``"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}``; ``type`` as written."""

    EXAMPLE: ClassVar[str] = '{"type": "AdamW", "params": {"lr": 0.001}}'
    IGNORED_KEYS: ClassVar[dict[str, str]] = {"legacy_fusion": "DeepSpeed fused-kernel switch"}

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerConfig:
    """``"scheduler": {"type": "WarmupLR", "params": {...}}``; ``type`` as written."""

    EXAMPLE: ClassVar[str] = '{"type": "WarmupLR", "params": {"warmup_num_steps": 100}}'

    type: str
    params: dict[str, Any] = field(default_factory=dict)


def parse_optimizer(raw: object, notes: Notes) -> OptimizerConfig:
    """Build and check the optimizer block (see the module docstring for what is checked)."""
    if not isinstance(raw, dict):
        raise fail(
            "optimizer", f"expected an object like {OptimizerConfig.EXAMPLE}, got {show(raw)}"
        )
    opt = build(OptimizerConfig, raw, "optimizer", notes)
    check_optimizer_params(opt.params, "optimizer.params")
    return opt


def check_optimizer_params(params: dict[str, Any], path: str) -> None:
    """Refuse ``max_grad_norm``, a non-positive ``lr`` and mistyped common parameters."""
    if "max_grad_norm" in params:
        raise ConfigError(
            f"{join(path, 'max_grad_norm')}: 'max_grad_norm' is not supported as an optimizer "
            "parameter; use the top-level key 'gradient_clipping' (e.g. \"gradient_clipping\": 1.0)",
            key=join(path, "max_grad_norm"),
        )
    for name, value in params.items():
        if name not in _PARAM_TYPES or value == AUTO:
            continue
        tp, bounds = _PARAM_TYPES[name]
        key = join(path, name)
        value = convert(value, tp, key)
        if name == "lr" and value <= 0:
            raise fail(key, f"the learning rate must be > 0, got {value!r}")
        if name == "betas" and not all(0 <= b < 1 for b in value):
            raise fail(key, f"each beta must be in [0, 1), got {list(value)!r}")
        check_bounds(value, bounds, key)
