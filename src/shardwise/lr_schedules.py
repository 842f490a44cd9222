"""The learning-rate scheduler a config's ``scheduler`` block names, built over an optimizer.

The schedules are DeepSpeed's (``lr_formulas.py``) or torch's, by name. The block was checked
when the config was parsed (``config/scheduler_params.py``); it is checked again here, once its
``"auto"`` values are resolved against the optimizer (docs/config.md, "Schedulers").
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise.config.errors import fail
from shardwise.config.optim_blocks import SchedulerConfig
from shardwise.config.scheduler_params import check_scheduler_config, resolve_auto, scheduler_class


def build_scheduler(cfg: SchedulerConfig, optimizer: Optimizer) -> LRScheduler:
    """The scheduler a config block names, bound to ``optimizer`` (or a wrapper's ``.optimizer``)."""
    if not isinstance(optimizer, Optimizer) and isinstance(
        getattr(optimizer, "optimizer", None), Optimizer
    ):
        optimizer = optimizer.optimizer  # e.g. a ZeRO wrapper around a torch optimizer
    resolved = SchedulerConfig(cfg.type, resolve_auto(cfg.params, optimizer))
    kwargs = check_scheduler_config(resolved)
    cls = scheduler_class(cfg.type)
    try:
        return cls(optimizer, **kwargs)
    except (TypeError, ValueError) as error:
        raise fail(
            "scheduler.params", f"{cls.__name__} refused these parameters: {error}"
        ) from None
