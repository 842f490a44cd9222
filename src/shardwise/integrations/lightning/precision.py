"""The precision plugin of ``ShardwiseStrategy``: backward and the step go through the engine.

Lightning hands every strategy a precision plugin made from ``Trainer(precision=...)``; the
strategy swaps it for this one (strategy.py), which keeps the name and lets the shardwise
config decide everything else: ``bf16-mixed``/``bf16-true`` enable the config's ``bf16``
block, ``16-mixed``/``16-true`` its ``fp16`` block (config.py), and the engine then keeps the
model in 16 bits with fp32 master weights (docs/lightning.md). What it does per call:

    convert_module   nothing: the engine casts the model (with fp32 masters) itself
    convert_input    floating tensors of a batch -> the engine's compute dtype
    backward         engine.backward(loss, scale_wrt_gas=False): Lightning already divided the
                     loss by accumulate_grad_batches
    optimizer_step   the closure (training_step + backward), Lightning's before-step hooks,
                     then engine.step(): clip, update, zero, on the accumulation boundary only
    clip_gradients   nothing: the config's gradient_clipping clips the global norm, each
                     element counted once whatever the layout (Trainer(gradient_clip_val) fills it)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

if TYPE_CHECKING:  # annotations only
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import Steppable
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType

SUPPORTED = ("32-true", "32", "bf16-mixed", "bf16-true", "bf16", "16-mixed", "16-true", "16")


class Stepping(Protocol):
    """What the plugin needs of the engine."""

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor: ...

    def step(self) -> None: ...


class ShardwisePrecision(Precision):
    """``Trainer(precision=...)`` under ``ShardwiseStrategy`` (module docstring)."""

    def __init__(self, precision: str = "32-true") -> None:
        precision = str(precision)
        if precision not in SUPPORTED:
            raise ValueError(
                f"Trainer(precision={precision!r}) is not supported by ShardwiseStrategy: use one "
                f"of {', '.join(SUPPORTED)} (the config's bf16/fp16 blocks say the rest)"
            )
        self.precision = precision  # type: ignore[assignment]
        self.input_dtype: torch.dtype | None = None  # set by the strategy from the engine's config
        self.engine: Stepping | None = None

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module

    def convert_input(self, data: Any) -> Any:
        dtype = self.input_dtype
        if dtype is None or dtype == torch.float32:
            return data
        return apply_to_collection(
            data, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t
        )

    def _engine(self) -> Stepping:
        if self.engine is None:
            raise RuntimeError("ShardwisePrecision is used before ShardwiseStrategy.setup")
        return self.engine

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Steppable | None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self._engine().backward(tensor, scale_wrt_gas=False)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Steppable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MisconfigurationException("ShardwiseStrategy cannot run LBFGS (it re-evaluates)")
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise MisconfigurationException(
                "training_step returned None (skipping backward) under ShardwiseStrategy: every "
                "rank must run backward, since gradients are reduced across ranks"
            )
        self._engine().step()
        return result

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType | None = None,
    ) -> None:
        """The engine clips (the config's ``gradient_clipping``); nothing to do here."""
