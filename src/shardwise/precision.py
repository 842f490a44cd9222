"""Precision policies: the compute dtype, and fp16's dynamic loss scale.

Mixed precision keeps the model (parameters, activations, gradients) in 16 bits and an fp32
master copy of the weights inside the optimizer; the optimizer steps the master copy and the
16-bit weights are its rounding. bf16 has fp32's exponent range, so it needs no loss scale.
fp16 gradients underflow below 6e-8, so the loss is multiplied by a scale S before backward
and the gradients by 1/S before the step:

    g = (1/S) * d(S * loss)/dw

Dynamic scaling (DeepSpeed's ``DynamicLossScaler``): an overflow (any inf/nan gradient on any
rank) skips the step; after ``hysteresis`` overflows the scale halves (never below
``min_loss_scale``); every ``loss_scale_window`` clean iterations since the last overflow it
doubles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.config import ConfigError
from shardwise.optim.adam import DeepSpeedCPUAdam

if TYPE_CHECKING:  # annotations only
    from torch.optim import Optimizer

    from shardwise.config import Config


def compute_dtype(config: Config) -> torch.dtype:
    """The dtype the model computes in under ``config`` (fp32 unless fp16/bf16 is enabled)."""
    if config.bf16.enabled:
        return torch.bfloat16
    if config.fp16.enabled:
        return torch.float16
    return torch.float32


def cast_module(module: nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` for its floating parameters and buffers, in place: each tensor's
    ``data`` is replaced, so parameters keep their identity. Unlike ``nn.Module.to`` this
    never swaps tensor objects, which tensor subclasses (fake tensors in plan/simulate.py)
    refuse."""
    for m in module.modules():
        for p in m.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                m._buffers[name] = b.to(dtype)


class LossScaler:
    """A static or dynamic loss scale with DeepSpeed's update rule."""

    def __init__(
        self,
        init_scale: float = 1.0,
        dynamic: bool = False,
        scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = float(init_scale)
        self.dynamic = dynamic
        self.scale_window = scale_window
        self.delayed_shift = hysteresis
        self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @classmethod
    def from_config(cls, config: Config) -> LossScaler:
        fp16 = config.fp16
        if not fp16.enabled:
            return cls()  # bf16 and fp32: a static scale of 1
        return cls(
            init_scale=fp16.initial_scale,
            dynamic=fp16.dynamic,
            scale_window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=fp16.min_loss_scale,
        )

    def update(self, overflow: bool) -> None:
        """Advance one iteration; ``overflow`` says whether its gradients were not finite."""
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.scale *= 2
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        keys = ("scale", "cur_hysteresis", "cur_iter", "last_overflow_iter")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def fp16_master(config: Config) -> bool:
    """``fp16.fp16_master_weights_and_grads`` in force (it means nothing without fp16, as in
    DeepSpeed, which reads it only from an enabled fp16 block)."""
    return config.fp16.enabled and config.fp16.fp16_master_weights_and_grads


def master_dtype(config: Config, optimizer: Optimizer) -> torch.dtype:
    """The dtype of the master weights and gradient shards the optimizer steps: fp32, or fp16
    under ``fp16_master_weights_and_grads``. DeepSpeed's rules for that (v0.16.5): ZeRO stage 2
    only, with the optimizer offloaded to the CPU (both checked by the config) and stepped by
    ``DeepSpeedCPUAdam``, whose fp32 states keep the update exact where the weights are not."""
    if not fp16_master(config):
        return torch.float32

    if not isinstance(optimizer, DeepSpeedCPUAdam):
        name = type(optimizer).__name__
        raise ConfigError(
            f"fp16.fp16_master_weights_and_grads needs DeepSpeedCPUAdam (as in DeepSpeed), the "
            f'optimizer is {name}: use an "Adam"/"AdamW" optimizer block (without '
            "torch_adam) or pass shardwise.ops.adam.DeepSpeedCPUAdam; or remove the key",
            key="fp16.fp16_master_weights_and_grads",
        )
    return torch.float16
