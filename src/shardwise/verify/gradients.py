"""Per-parameter gradient norms of the single-process run, to find parameters whose gradient
is zero up to rounding.

Such a parameter (a bias just before a BatchNorm, which subtracts any shift; an attention key
bias, which softmax ignores) has an exact gradient of 0, so its computed gradient is rounding
noise, different in every summation order. Adam normalizes it, m / (sqrt(v) + eps), into a
move of up to lr per step in a random direction (design notes), so one process and a correct
layout can differ there by several lr while agreeing everywhere else. Such a parameter cannot
change the loss either; verify names it and leaves it unjudged.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

ZERO_GRAD = 1e-6  # a tensor's gradient norm below this share of the global norm: zero


class GradNorms:
    """Sums each parameter's gradients over the micro-batches of a step (tensor hooks)."""

    def __init__(self, model: nn.Module) -> None:
        self.acc: dict[str, torch.Tensor] = {}
        self.steps: list[dict[str, float]] = []
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.register_hook(partial(self._add, name))

    def _add(self, name: str, grad: torch.Tensor) -> None:
        g = grad.detach().float()
        self.acc[name] = self.acc[name] + g if name in self.acc else g.clone()

    def end_step(self) -> None:
        self.steps.append({n: float(g.norm()) for n, g in self.acc.items()})
        self.acc = {}


def zero_gradient(steps: list[dict[str, float]], norms: list[float | None]) -> list[str]:
    """Parameters whose gradient norm stayed below ZERO_GRAD x the global norm at every step."""
    if not steps:
        return []
    names = set(steps[0])
    for step, norm in zip(steps, norms, strict=True):
        if norm is None or norm == 0:
            return []
        names = {n for n in names if step.get(n, 0.0) <= ZERO_GRAD * norm}
    return [n for n in steps[0] if n in names]
