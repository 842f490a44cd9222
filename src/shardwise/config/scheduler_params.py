"""The ``scheduler`` block: parsed, and its ``params`` checked at parse time and build time.

DeepSpeed's schedulers (:mod:`shardwise.lr_formulas`) get their parameter names, required keys,
types (from the constructor annotations) and bounds checked; torch's get names and required keys.
"auto" is resolved only where it has a meaningful source (``_AUTO_SOURCES``).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise.config.errors import ConfigError, Notes, did_you_mean, fail, join, show
from shardwise.config.optim_blocks import SchedulerConfig
from shardwise.config.schema import AUTO, build, check_bounds, convert
from shardwise.lr_formulas import DEEPSPEED_SCHEDULERS

# Bounds of the DeepSpeed schedulers' parameters (each element, for per-group lists).
_BOUNDS: dict[str, dict[str, float]] = {
    "warmup_min_lr": {"ge": 0},
    "warmup_max_lr": {"gt": 0},
    "warmup_num_steps": {"ge": 0},
    "total_num_steps": {"ge": 1},
    "warmup_min_ratio": {"ge": 0, "le": 1},
    "cos_min_ratio": {"ge": 0, "le": 1},
    "cycle_min_lr": {"ge": 0},
    "cycle_max_lr": {"gt": 0},
    "decay_lr_rate": {"ge": 0},
    "cycle_first_step_size": {"ge": 1},
    "cycle_second_step_size": {"ge": 1},
    "cycle_first_stair_count": {"ge": 0},
    "cycle_second_stair_count": {"ge": 0},
    "decay_step_size": {"ge": 0},
    "cycle_min_mom": {"ge": 0, "le": 1},
    "cycle_max_mom": {"ge": 0, "le": 1},
    "lr_range_test_min_lr": {"gt": 0},
    "lr_range_test_step_size": {"ge": 1},
    "lr_range_test_step_rate": {"ge": 0},
    "last_batch_iteration": {"ge": -1},
}
# "auto" values that have a meaningful source; any other "auto" is refused at build time.
_AUTO_SOURCES = {
    "warmup_min_lr": "0",
    "warmup_max_lr": "the optimizer's lr of each parameter group",
}


def scheduler_class(name: str) -> type[LRScheduler]:
    """DeepSpeed's scheduler of that name (any case), else ``torch.optim.lr_scheduler.<name>``."""
    lowered = {key.lower(): cls for key, cls in DEEPSPEED_SCHEDULERS.items()}
    if name.lower() in lowered:
        return lowered[name.lower()]
    found = getattr(torch.optim.lr_scheduler, name, None)
    if inspect.isclass(found) and issubclass(found, LRScheduler) and found is not LRScheduler:
        return found
    torch_names = sorted(
        n
        for n, c in vars(torch.optim.lr_scheduler).items()
        if inspect.isclass(c)
        and issubclass(c, LRScheduler)
        and not n.startswith("_")
        and c is not LRScheduler
    )
    hint = did_you_mean(name, [*DEEPSPEED_SCHEDULERS, *torch_names])
    raise fail(
        "scheduler.type",
        f"unknown scheduler {name!r}{hint or '.'} Valid: {', '.join(DEEPSPEED_SCHEDULERS)} "
        f"(DeepSpeed's) or a torch.optim.lr_scheduler class ({', '.join(torch_names)})",
    )


def parse_scheduler(raw: object, notes: Notes) -> SchedulerConfig:
    """Build the scheduler block; its type must exist and its params must fit that scheduler."""
    if not isinstance(raw, dict):
        raise fail(
            "scheduler", f"expected an object like {SchedulerConfig.EXAMPLE}, got {show(raw)}"
        )
    sched = build(SchedulerConfig, raw, "scheduler", notes)
    check_scheduler_config(sched, allow_auto=True)
    return sched


def check_scheduler_config(cfg: SchedulerConfig, allow_auto: bool = False) -> dict[str, Any]:
    """The scheduler's keyword arguments, checked: names, required keys, types and bounds.

    Types and bounds are checked for DeepSpeed's schedulers; torch's are checked by name only.
    With ``allow_auto`` (parse time) "auto" values are skipped; they are resolved when built.
    """
    cls = scheduler_class(cfg.type)
    signature = inspect.signature(cls.__init__)
    accepted = [
        p for p in list(signature.parameters.values())[2:] if p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    names = {p.name for p in accepted}
    for key in cfg.params:
        if key not in names:
            where = join("scheduler.params", key)
            hint = did_you_mean(key, names)
            raise ConfigError(f"unknown key '{where}' for {cls.__name__}{hint}", key=where)
    for p in accepted:
        if p.default is p.empty and p.name not in cfg.params:
            raise fail(join("scheduler.params", p.name), f"this key is required by {cls.__name__}")
    if not getattr(cls, "DEEPSPEED_STYLE", False):
        return dict(cfg.params)
    hints = typing.get_type_hints(cls.__init__)
    kwargs = {}
    for key, value in cfg.params.items():
        path = join("scheduler.params", key)
        if value == AUTO:
            if not allow_auto:
                raise fail(path, '"auto" needs a value: shardwise does not fill it in here')
            kwargs[key] = value
            continue
        kwargs[key] = convert(value, hints[key], path)
        for item in kwargs[key] if isinstance(kwargs[key], list) else [kwargs[key]]:
            check_bounds(item, _BOUNDS.get(key, {}), path)
    return kwargs


def resolve_auto(params: dict[str, Any], optimizer: Optimizer) -> dict[str, Any]:
    """Replace the "auto" values that have a source (see ``_AUTO_SOURCES``); refuse the others."""
    resolved = dict(params)
    for key, value in params.items():
        if value != AUTO:
            continue
        if key == "warmup_min_lr":
            resolved[key] = 0.0
        elif key == "warmup_max_lr":
            resolved[key] = [float(group["lr"]) for group in optimizer.param_groups]
        else:
            raise fail(
                join("scheduler.params", key),
                f'"auto" needs a value: shardwise fills in "auto" only for {", ".join(_AUTO_SOURCES)} '
                "(the Hugging Face Trainer fills the rest from its arguments); give a number, e.g. "
                f"cfg.with_values({{'scheduler.params.{key}': ...}})",
            )
    return resolved
