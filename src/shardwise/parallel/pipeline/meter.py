"""How many bytes of activations autograd stores for backward, now and at the peak.

A saved-tensor hook (``torch.autograd.graph.saved_tensors_hooks``) sees every tensor autograd
keeps for the backward of the operations run inside it. The meter books each one's bytes when
it is saved and releases them when autograd drops it (after that backward, or when the graph is
freed). Parameters are left out (they are stored anyway; a matmul saves its weight, or a view of
it): what remains is the activation memory a schedule decides, the quantity GPipe and 1F1B
differ in (m micro-batches against at most p - s on stage s).

Counted per saved tensor: two saves of one tensor count twice. The count is exact for
comparisons between schedules of one model, which is its purpose.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _Held:
    """A saved tensor; gives its bytes back to the meter when autograd lets it go."""

    __slots__ = ("meter", "nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter) -> None:
        self.tensor, self.meter = tensor, meter
        self.nbytes = tensor.numel() * tensor.element_size()
        meter.live += self.nbytes
        meter.peak = max(meter.peak, meter.live)

    def __del__(self) -> None:
        self.meter.live -= self.nbytes


class ActivationMeter:
    """``with meter.hooks(): out = stage(x)`` books what the forward stores; ``live``/``peak``."""

    def __init__(self, module: nn.Module) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.live = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = self.live

    def hold(self, t: torch.Tensor) -> object:
        """Book ``t`` until the returned token is dropped: what a zero-bubble schedule keeps
        from B for W (each linear's input and output gradient) once autograd let go of it."""
        return _Held(t, self)

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() in self._params:
            return t
        return _Held(t, self)

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held
