"""DeepSpeed's learning-rate schedules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.

They import nothing of ``shardwise.config``: the config checks its scheduler block against them
(config/scheduler_params.py), and ``shardwise.lr_schedules.build_scheduler`` builds one from it.

Same names, parameters, defaults and formulas as DeepSpeed 0.19.8 (deepspeed/runtime/lr_schedules.py;
the defaults are pinned by tests/test_scheduler_defaults.py); written from those formulas, so
``state_dict``/``load_state_dict``, ``get_last_lr`` and torch's tooling work. Counting follows
DeepSpeed: ``it`` (``last_batch_iteration``) is -1 before the first ``step()``, and after k calls to
``step()`` it is k - 1 (torch's ``last_epoch`` is it + 1).
Each lr is a closed form of ``it``; W = max(2, warmup_num_steps), T = total_num_steps:

- WarmupLR:       lr = min + (max - min) * g(it); g = ln(it + 1) / ln(W) ("log") or it / W
                  ("linear") for 0 <= it < W, 0 before the first step, 1 after the warmup.
- WarmupDecayLR:  as WarmupLR, then g = max(0, (T - it) / max(1, T - W)) for it >= W.
- WarmupCosineLR: lr = base_lr * r; warmup r = wmin + (1 - wmin) * g(it); then with
                  p = min(1, (it - W + 1) / max(1, T - W)): r = cmin + (1 - cmin) * (1 + cos(pi p)) / 2.
- OneCycle:       with b = it + 1 and x = b / (s1 + s2) mod 1: lr rises from cycle_min_lr to
                  cycle_max_lr while x <= s1 / (s1 + s2), then falls back; momentum (Adam beta1)
                  moves the other way. After the cycle: lr = cycle_min_lr / (1 + decay_lr_rate * n /
                  decay_step_size), n = it - (s1 + s2) + 1 (no decay when either is 0).
- LRRangeTest:    lr = min_lr * (1 + step_rate * (it + 1) / step_size) (floored with staircase).

``warmup_max_lr`` left out is DeepSpeed's: the optimizer's lr per parameter group for WarmupLR,
0.001 for WarmupDecayLR. Deliberate differences from DeepSpeed (docs/config.md says why; each warns
with a DeepSpeedDifferenceWarning): WarmupCosineLR is ``wmin * base_lr`` before the first step
(DeepSpeed: 0); OneCycle keeps each group's own beta2 (DeepSpeed sets 0.99) and starts at
cycle_max_mom, the value its formula gives at the lr minimum (DeepSpeed starts at cycle_min_mom);
an unknown ``warmup_type`` is an error (DeepSpeed falls back to "log").
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise.errors import DeepSpeedDifferenceWarning

Lr = float | list[float]


def _per_group(value: float | list[float], n: int, name: str) -> list[float]:
    """A scalar for every parameter group, or one value per group (DeepSpeed accepts both)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(
                f"{name}: expected {n} values (one per parameter group), got {len(value)}"
            )
        return [float(v) for v in value]
    return [float(value)] * n


def _differs(what: str) -> None:
    """Say where this schedule runs differently from DeepSpeed 0.19's (docs/config.md: why)."""
    warnings.warn(
        f"{what} (a deliberate difference, docs/config.md)",
        DeepSpeedDifferenceWarning,
        stacklevel=3,
    )


def _warmup_fraction(it: int, steps: int, kind: str) -> float:
    """g(it) in [0, 1) during the warmup: ln(it + 1) / ln(steps) or it / steps; 0 before step 1."""
    if it < 0:
        return 0.0
    return math.log(it + 1) / math.log(steps) if kind == "log" else it / steps


class _IterationLR(LRScheduler):
    """Base: a closed-form ``lr_at(it, group, base_lr)``, DeepSpeed's iteration count and state."""

    DEEPSPEED_STYLE = True  # parameters typed and bounded by config.scheduler_params

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer)  # sets the lr of iteration -1
        if last_batch_iteration != -1:
            self.last_epoch = last_batch_iteration + 1
            self._apply()

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: -1 before the first step(), k - 1 after k steps."""
        return self.last_epoch - 1

    def lr_at(self, it: int, group: int, base_lr: float) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return [
            self.lr_at(self.last_batch_iteration, i, float(b)) for i, b in enumerate(self.base_lrs)
        ]

    def step(self, last_batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance one iteration, or jump to ``last_batch_iteration`` (DeepSpeed's argument)."""
        if last_batch_iteration is not None:
            self.last_epoch = last_batch_iteration  # super().step() adds the 1
        super().step()
        self._after_update()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        self._after_update()

    def _after_update(self) -> None:
        """Hook run after the lrs change (OneCycle sets the momentum here)."""

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["last_batch_iteration"] = self.last_batch_iteration
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads torch's format, or DeepSpeed's ``{"last_batch_iteration": n}`` (whose lrs
        are then computed: ``get_last_lr()`` answers for the loaded iteration, not the
        constructor's)."""
        state = dict(state_dict)
        it = state.pop("last_batch_iteration", None)
        if "last_epoch" not in state and it is not None:
            state["last_epoch"] = it + 1
        super().load_state_dict(state)
        if "_last_lr" not in state:
            self._last_lr = self.get_lr()


class WarmupLR(_IterationLR):
    """min -> max over ``warmup_num_steps`` iterations ("log" or "linear"), then constant max."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: Lr = 0.0,
        warmup_max_lr: Lr | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: Literal["log", "linear"] = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        if warmup_type not in ("log", "linear"):
            raise ValueError(f'warmup_type must be "log" or "linear", got {warmup_type!r}')
        self.min_lrs = _per_group(warmup_min_lr, n, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, n, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def gamma(self, it: int) -> float:
        """Fraction of the way from min to max at iteration ``it``."""
        if it < self.warmup_num_steps:
            return _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, it: int, group: int, base_lr: float) -> float:
        low, high = self.min_lrs[group], self.max_lrs[group]
        return low + (high - low) * self.gamma(it)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to ``warmup_min_lr`` at ``total_num_steps``.

    Unlike WarmupLR, ``warmup_max_lr`` defaults to 0.001 (DeepSpeed's signature), not to the
    optimizer's lr."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: Lr = 0.0,
        warmup_max_lr: Lr | None = 0.001,  # DeepSpeed's; None: the optimizer's lr, as WarmupLR
        warmup_num_steps: int = 1000,
        warmup_type: Literal["log", "linear"] = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return super().gamma(it)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - it) / span)


class WarmupCosineLR(_IterationLR):
    """Ratio of each group's lr: warmup from ``warmup_min_ratio`` to 1, cosine down to ``cos_min_ratio``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: Literal["log", "linear"] = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f'warmup_type must be "log" or "linear", got {warmup_type!r}')
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        if warmup_min_ratio > 0 and last_batch_iteration == -1:
            _differs(
                f"WarmupCosineLR: the first optimizer step uses warmup_min_ratio * lr "
                f"({warmup_min_ratio} * lr); DeepSpeed's uses lr 0, so that step changes nothing"
            )
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, it: int) -> float:
        """The multiplier of the optimizer's lr at iteration ``it``."""
        if it < self.warmup_num_steps:
            fraction = _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, it: int, group: int, base_lr: float) -> float:
        return base_lr * self.ratio(it)


class OneCycle(_IterationLR):
    """1Cycle (Smith 2018): lr up then down over one cycle, momentum the other way, then decay."""

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: Lr,
        cycle_max_lr: Lr,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        self.min_lrs = _per_group(cycle_min_lr, n, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, n, "cycle_max_lr")
        self.first = cycle_first_step_size
        self.second = (
            cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size
        )
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_lr_rate, self.decay_step_size = decay_lr_rate, decay_step_size
        self.min_mom, self.max_mom, self.decay_mom_rate = (
            cycle_min_mom,
            cycle_max_mom,
            decay_mom_rate,
        )
        # Momentum is Adam's beta1; optimizers without betas (e.g. SGD) keep theirs, as in DeepSpeed.
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if self.cycle_momentum:
            _differs(
                "OneCycle: beta1 starts at cycle_max_mom (DeepSpeed: cycle_min_mom for the first "
                "step, then its formula, which gives cycle_max_mom at the lr minimum) and beta2 "
                "stays each group's own (DeepSpeed sets 0.99)"
            )
        super().__init__(optimizer, last_batch_iteration)

    def scale(self, it: int) -> float:
        """Height in the cycle, 0 (min lr) .. 1 (max lr), at iteration ``it`` (stairs: floored)."""
        total = self.first + self.second
        pos = (it + 1) % total  # iterations into the current cycle
        if pos <= self.first:
            fraction, stairs = pos / self.first, self.first_stairs
        else:
            fraction, stairs = (total - pos) / self.second, self.second_stairs
        if stairs > 0:  # exact: floor of an integer ratio, no float rounding at a stair edge
            steps = pos if pos <= self.first else total - pos
            size = self.first if pos <= self.first else self.second
            return (steps * stairs // size) / stairs
        return fraction

    def _decay_intervals(self, it: int, rate: float) -> float:
        if self.decay_step_size == 0 or rate == 0:
            return 0.0
        return (it - (self.first + self.second) + 1) / self.decay_step_size

    def lr_at(self, it: int, group: int, base_lr: float) -> float:
        low, high = self.min_lrs[group], self.max_lrs[group]
        if it < self.first + self.second:
            return low + (high - low) * self.scale(it)
        return low / (1.0 + self.decay_lr_rate * self._decay_intervals(it, self.decay_lr_rate))

    def momentum_at(self, it: int) -> float:
        """beta1 at iteration ``it``: max_mom at the lr minimum, min_mom at the lr peak."""
        if it < self.first + self.second:
            return self.max_mom - (self.max_mom - self.min_mom) * self.scale(it)
        return self.max_mom * (
            1.0 + self.decay_mom_rate * self._decay_intervals(it, self.decay_mom_rate)
        )

    def _after_update(self) -> None:
        if self.cycle_momentum:
            beta1 = self.momentum_at(self.last_batch_iteration)
            for group in self.optimizer.param_groups:
                group["betas"] = (beta1, group["betas"][1])


class LRRangeTest(_IterationLR):
    """LR range test: the lr grows linearly (or in stairs) from ``lr_range_test_min_lr``."""

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: Lr = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.min_lrs = _per_group(
            lr_range_test_min_lr, len(optimizer.param_groups), "lr_range_test_min_lr"
        )
        self.step_size, self.step_rate = lr_range_test_step_size, lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def lr_at(self, it: int, group: int, base_lr: float) -> float:
        intervals = (it + 1) / self.step_size
        if self.staircase:
            intervals = math.floor(intervals)
        return self.min_lrs[group] * (1.0 + self.step_rate * intervals)


DEEPSPEED_SCHEDULERS: dict[str, type[_IterationLR]] = {
    cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}
