"""What the engine hands down: ``TrainParts``, the typed parts of one training run.

The engine (engine.py) composes these parts and keeps DeepSpeed's call surface; every module
that works for it (the pipeline's schedule runner, the monitor, the checkpoint save and load,
the replica check) receives the parts, or the few fields it needs, never the ``Engine`` itself,
and reports back through return values. So a reader of such a module sees everything it can
touch in one dataclass, and nothing outside ``shardwise.training`` writes into the engine.

``BatchStrategy`` is how whole batches run (``engine.train_batch`` / ``eval_batch``): the plain
micro-batch loop (batch_loop.py) or the pipeline's schedule (parallel/pipeline/train_batch.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from shardwise.errors import EngineError

if TYPE_CHECKING:  # annotations only
    from shardwise.config import BatchSizes, Config
    from shardwise.data import DistributedDataLoader
    from shardwise.parallel.context.scope import ContextParallel
    from shardwise.parallel.strategy_contract import GradientStrategy
    from shardwise.precision import LossScaler
    from shardwise.topology import ProcessMesh
    from shardwise.training.counters import TrainingCounters


@dataclass
class TrainParts:
    """The parts of a training run (the module docstring). ``module`` is the model as
    ``initialize`` prepared it (this rank's stage, tensor-parallel layers, cast); ``strategy``
    the gradient strategy (parallel/strategy_contract.py); ``batch`` the resolved batch sizes;
    ``counters`` the step counters checkpoints save whole; ``context`` the context-parallel
    scope (inactive without context parallelism)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    strategy: GradientStrategy
    mesh: ProcessMesh
    config: Config
    batch: BatchSizes
    scaler: LossScaler
    counters: TrainingCounters
    context: ContextParallel
    training_dataloader: DistributedDataLoader | None = None
    loss_fn: Callable[..., Any] | None = None

    def lrs(self) -> list[float]:
        """Each parameter group's learning rate (DeepSpeed's ``engine.get_lr()``)."""
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def data(self, data_iter: Iterator | None) -> Iterator:
        """``data_iter``, else the endless iterator of the loader given to ``initialize`` (the
        loader owns it and its position, so that a checkpoint resumes it)."""
        if data_iter is not None:
            return data_iter
        if self.training_dataloader is None:
            raise EngineError(
                "train_batch() needs data_iter, or training_data given to initialize()"
            )
        return self.training_dataloader.repeating()


class BatchStrategy(Protocol):
    """How ``engine.train_batch`` / ``eval_batch`` run a whole batch of GAS micro-batches.

    ``train_batch`` trains one optimizer step and returns the mean loss over the micro-batches,
    averaged over the data-parallel ranks (the same value on every rank); ``update`` is the
    engine's update at the accumulation boundary (clip, optimizer and scheduler step), for a
    strategy that decides itself when it runs (the pipeline's schedule). The engine sets the
    module's train/eval mode around both calls."""

    def train_batch(
        self, parts: TrainParts, data_iter: Iterator | None, update: Callable[[], None]
    ) -> torch.Tensor: ...

    def eval_batch(self, parts: TrainParts, data_iter: Iterator | None, **kwargs: Any) -> Any: ...
