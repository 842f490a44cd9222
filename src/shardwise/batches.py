"""Whole batches: what ``engine.train_batch`` / ``eval_batch`` run when there is no pipeline.

``MicroBatchLoop`` is the engine's batch strategy without a pipeline: GAS micro-batches, each
``loss_fn(module(inputs), labels)`` (or the module's own loss), through the engine's
``backward`` and ``step``, so every rule of those calls holds. With a pipeline the engine holds
a ``PipelineRunner`` instead (parallel/pipeline/runner.py), which answers the same two calls
by running a schedule.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from shardwise import comm


def data_or_loader(engine: Any, data_iter: Iterator | None) -> Iterator:
    """``data_iter``, else an endless iterator over the loader given to ``initialize`` (kept
    on the engine as ``_data_iter``, so that a checkpoint can resume its position)."""
    if data_iter is not None:
        return data_iter
    if engine.training_dataloader is None:
        from shardwise.engine import EngineError

        raise EngineError("train_batch() needs data_iter, or training_data given to initialize()")
    if getattr(engine, "_data_iter", None) is None:
        from shardwise.data import RepeatingLoader

        engine._data_iter = iter(RepeatingLoader(engine.training_dataloader))
    return engine._data_iter


def loss_of(engine: Any, batch: Any) -> torch.Tensor:
    """The loss of one micro-batch: ``loss_fn(module(inputs), labels)`` when a loss function
    was given (batch = (inputs, labels)), else the module's own output, which must then be
    the loss (or a tuple/dict whose first value / "loss" is)."""
    if engine.loss_fn is not None:
        inputs, labels = batch
        out = engine(*inputs) if isinstance(inputs, (tuple, list)) else engine(inputs)
        return engine.loss_fn(out, labels)
    out = engine(*batch) if isinstance(batch, (tuple, list)) else engine(batch)
    if isinstance(out, dict):
        out = out["loss"]
    elif isinstance(out, (tuple, list)):
        out = out[0]
    return out


def _dp_mean(engine: Any, total: torch.Tensor) -> torch.Tensor:
    total /= engine.gradient_accumulation_steps()
    comm.all_reduce(total, group=engine.mesh.dp_group)
    return total / engine.dp_world_size


class MicroBatchLoop:
    """GAS micro-batches through forward / backward / step (see the module docstring)."""

    def train_batch(self, engine: Any, data_iter: Iterator | None) -> torch.Tensor:
        data_iter = data_or_loader(engine, data_iter)
        engine.train()
        total = torch.zeros(())
        for _ in range(engine.gradient_accumulation_steps()):
            loss = loss_of(engine, next(data_iter))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().cpu()
        return _dp_mean(engine, total)

    @torch.no_grad()
    def eval_batch(self, engine: Any, data_iter: Iterator, **kwargs: Any) -> torch.Tensor:
        if kwargs:
            from shardwise.engine import EngineError

            raise EngineError(f"eval_batch() got {sorted(kwargs)}: only pipelines take options")
        was_training = engine.training
        engine.eval()
        total = torch.zeros(())
        for _ in range(engine.gradient_accumulation_steps()):
            total += loss_of(engine, next(data_iter)).float().cpu()
        engine.train(was_training)
        return _dp_mean(engine, total)
