"""``FusedAdam`` and ``DeepSpeedCPUAdam`` with DeepSpeed's signatures and defaults
(``shardwise.ops.adam`` gives them DeepSpeed's import path).

One step, per element, with g the gradient, p the parameter, t the step count (DeepSpeed's
``multi_tensor_adam``):

    adam_w_mode false (L2):  g <- g + wd * p
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    with bias_correction:    m_hat = m / (1 - b1^t),  v_hat = v / (1 - b2^t)
    without:                 m_hat = m,               v_hat = v
    adam_w_mode true:        p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)
    adam_w_mode false:       p <- p - lr * m_hat / (sqrt(v_hat) + eps)

Defaults are DeepSpeed's (``lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0``,
``adam_w_mode=True``, ``bias_correction=True``); torch's ``AdamW`` defaults ``weight_decay`` to
0.01, which is why a config's ``"type": "Adam"`` must not be handed to it with torch's defaults.
Written with plain tensor ops, so the same code runs on CPU and CUDA; ``amsgrad`` is refused as
DeepSpeed refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class FusedAdam(torch.optim.Optimizer):
    """DeepSpeed's ``FusedAdam`` (the math in the module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise RuntimeError(f"{type(self).__name__} does not support the AMSGrad variant")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
        )
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    fp32_optimizer_states = False  # DeepSpeedCPUAdam: fp32 states (and math) for 16-bit p

    def _update(self, param: torch.Tensor, group: dict) -> None:
        b1, b2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        state = self.state[param]
        # 16-bit parameters with fp32 states: the update runs on an fp32 copy and is rounded
        # into the parameter once (DeepSpeed's CPU Adam kernel does the same per element).
        wide = self.fp32_optimizer_states and param.dtype != torch.float32
        p = param.float() if wide else param
        if not state:
            state["step"] = torch.tensor(0.0)  # a CPU tensor, as torch's Adam keeps it
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t = int(state["step"])
        m, v, g = state["exp_avg"], state["exp_avg_sq"], param.grad.to(p.dtype)
        if wd and not group["adam_w_mode"]:
            g = g.add(p, alpha=wd)  # L2: the decay is part of the gradient
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        c1, c2 = 1.0, 1.0
        if group["bias_correction"]:
            c1, c2 = 1 - b1**t, 1 - b2**t
        denom = (v / c2).sqrt_().add_(eps)
        if wd and group["adam_w_mode"]:
            p.mul_(1 - lr * wd)  # decoupled: lr * wd * p, from p before this step's update
        p.addcdiv_(m, denom, value=-lr / c1)
        if wide:
            param.copy_(p)


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam``: the same update. With ``fp32_optimizer_states``
    (the default) the states of 16-bit parameters are fp32 and the update is computed in fp32,
    then rounded into the parameter: what ``fp16.fp16_master_weights_and_grads`` relies on."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adamw_mode,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
        )
        self.fp32_optimizer_states = fp32_optimizer_states
