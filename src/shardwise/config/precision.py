"""The ``fp16`` and ``bf16`` blocks (DeepSpeed key names and 0.19.8's code defaults,
deepspeed/runtime/precision_config.py; pinned by tests/test_config_defaults.py).

fp16 dynamic loss scaling (DeepSpeed ``DynamicLossScaler``): the first scale is
``2 ** initial_scale_power``; an overflow skips the step and, once ``hysteresis`` overflows have been
absorbed, halves the scale (never below ``min_loss_scale``); ``loss_scale_window`` clean steps in a
row double it. ``loss_scale: 0`` means dynamic, any other value is a fixed scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardwise.config.errors import fail
from shardwise.config.schema import spec

# fp16-only keys people leave in a bf16 block (ds_tests_torch_compile_zero3_bf16.json does);
# DeepSpeed ignores them there, and so do we, with a warning: bf16 needs no loss scaling.
_LOSS_SCALE_KEYS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "auto_cast",
    "fp16_master_weights_and_grads",
)


@dataclass(frozen=True)
class FP16Config:
    """``"fp16": {...}``: half precision with a loss scale."""

    EXAMPLE: ClassVar[str] = '{"enabled": true}'
    IGNORED_KEYS: ClassVar[dict[str, str]] = {"fused_mode": "legacy DeepSpeed kernel switch"}

    enabled: bool = False
    loss_scale: float = spec(0.0, ge=0)  # 0 = dynamic loss scaling
    initial_scale_power: int = spec(16, ge=0)  # first dynamic scale = 2**initial_scale_power
    loss_scale_window: int = spec(1000, ge=1)  # clean steps before the scale doubles
    hysteresis: int = spec(2, ge=1)  # overflows absorbed before the scale halves
    consecutive_hysteresis: bool = False  # refill the hysteresis on every clean step
    min_loss_scale: float = spec(1.0, gt=0)
    auto_cast: bool = False  # cast module inputs to fp16
    fp16_master_weights_and_grads: bool = False  # keep master weights in fp16 (ZeRO-2 only)

    @property
    def dynamic(self) -> bool:
        """True when the loss scale adapts (``loss_scale == 0``)."""
        return self.loss_scale == 0

    @property
    def initial_scale(self) -> float:
        """The loss scale before the first step: ``2**initial_scale_power`` or the static scale."""
        return float(2**self.initial_scale_power) if self.dynamic else self.loss_scale


@dataclass(frozen=True)
class BF16Config:
    """``"bf16": {...}`` (legacy name ``"bfloat16"``): bfloat16 compute, no loss scaling."""

    EXAMPLE: ClassVar[str] = '{"enabled": true}'
    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        **{key: "fp16 loss-scaling key; bf16 uses no loss scale" for key in _LOSS_SCALE_KEYS},
        "immediate_grad_update": "DeepSpeed BF16_Optimizer detail",
        "check_grad_overflow": "DeepSpeed BF16_Optimizer detail",
    }

    enabled: bool = False
    # DeepSpeed 0.19's bf16-only masters and optimizer states: not implemented here.
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    def __post_init__(self) -> None:
        for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if getattr(self, key):
                raise fail(
                    f"bf16.{key}",
                    "bf16 master weights / optimizer states are not supported by shardwise "
                    "(masters and states stay fp32); remove the key or set it to false",
                )
