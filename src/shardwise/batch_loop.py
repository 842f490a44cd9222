"""Whole batches: what ``engine.train_batch`` / ``eval_batch`` run when there is no pipeline.

``MicroBatchLoop`` is the engine's batch strategy without a pipeline: GAS micro-batches, each
``loss_fn(module(inputs), labels)`` (or the module's own loss), through the engine's
``backward`` and ``step``, so every rule of those calls holds. With a pipeline the engine holds
a ``PipelineRunner`` instead (parallel/pipeline/train_batch.py), which answers the same two calls
by running a schedule.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from shardwise import comm
from shardwise.errors import EngineError

if TYPE_CHECKING:  # annotations only
    from shardwise.engine import Engine


def data_or_loader(engine: Engine, data_iter: Iterator | None) -> Iterator:
    """``data_iter``, else the endless iterator of the loader given to ``initialize`` (the
    loader owns it and its position, so that a checkpoint resumes it)."""
    if data_iter is not None:
        return data_iter
    if engine.training_dataloader is None:
        raise EngineError("train_batch() needs data_iter, or training_data given to initialize()")
    return engine.training_dataloader.repeating()


def loss_of(engine: Engine, batch: Any) -> torch.Tensor:
    """The loss of one micro-batch.

    With a ``loss_fn`` given to ``initialize``: batch = (inputs, labels) and the loss is
    ``loss_fn(module(inputs), labels)``. Without one, the module computes its own loss: a
    mapping (what Hugging Face datasets yield: ``{"input_ids", "labels", ...}``) is passed as
    keyword arguments, a tuple/list positionally, anything else as the one argument. The loss is
    the output itself, or its ``loss`` (a Hugging Face ``ModelOutput`` or a dict), or the first
    value of a tuple/list. Under context parallelism every tensor of two or more dimensions
    is first cut to this rank's tokens along dim 1.
    """
    batch, context_loss = engine.context.batch_loss(batch)  # context parallelism: its tokens
    if context_loss is not None:
        return context_loss(_call(engine, batch))
    if engine.loss_fn is not None:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise _batch_error(batch, "with a loss_fn, each batch must be (inputs, labels)")
        inputs, labels = batch
        return engine.loss_fn(_call(engine, inputs), labels)
    return _loss_from(_call(engine, batch), batch)


def _call(engine: Engine, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return engine(**inputs)
    if isinstance(inputs, (tuple, list)):
        return engine(*inputs)
    return engine(inputs)


def _loss_from(out: Any, batch: Any) -> torch.Tensor:
    loss = out
    if isinstance(out, Mapping) or hasattr(out, "loss"):  # a dict or a HF ModelOutput
        loss = out.get("loss") if isinstance(out, Mapping) else out.loss
    elif isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise _batch_error(
            batch,
            f"the model returned {_describe(out)}, not a loss: without a loss_fn the model "
            "must return the loss (a scalar tensor, a dict / ModelOutput with a 'loss', or a "
            "tuple whose first value is the loss); pass labels in the batch (e.g. "
            '{"input_ids": ..., "labels": ...}) or give initialize(loss_fn=...)',
        )
    return loss


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a mapping with keys {sorted(map(str, value))}"
    return type(value).__name__


def _batch_error(batch: Any, why: str) -> Exception:

    return EngineError(f"train_batch/eval_batch: {why} (got {_describe(batch)})")


def _dp_mean(engine: Engine, total: torch.Tensor) -> torch.Tensor:
    total /= engine.gradient_accumulation_steps()
    comm.all_reduce(total, group=engine.mesh.dp_cp_group)  # context ranks: other tokens
    return total / engine.mesh.topology.dp_cp


class MicroBatchLoop:
    """GAS micro-batches through forward / backward / step (see the module docstring)."""

    def train_batch(self, engine: Engine, data_iter: Iterator | None) -> torch.Tensor:
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
    def eval_batch(self, engine: Engine, data_iter: Iterator, **kwargs: Any) -> torch.Tensor:
        if kwargs:
            raise EngineError(f"eval_batch() got {sorted(kwargs)}: only pipelines take options")
        was_training = engine.training
        engine.eval()
        total = torch.zeros(())
        for _ in range(engine.gradient_accumulation_steps()):
            total += loss_of(engine, next(data_iter)).float().cpu()
        engine.train(was_training)
        return _dp_mean(engine, total)
