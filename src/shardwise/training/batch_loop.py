"""Whole batches: what ``engine.train_batch`` / ``eval_batch`` run when there is no pipeline.

``MicroBatchLoop`` is the engine's batch strategy (parts.BatchStrategy) without a pipeline: GAS
micro-batches, each ``loss_fn(module(inputs), labels)`` (or the module's own loss), through the
engine's ``backward`` and ``step``, so every rule of those calls holds; it is the one batch
strategy that drives the engine itself. With a pipeline the engine holds a ``PipelineRunner``
instead (parallel/pipeline/train_batch.py), which answers the same two calls by running a
schedule over the parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from shardwise import comm
from shardwise.errors import EngineError

if TYPE_CHECKING:  # annotations only
    from shardwise.parallel.context.scope import ContextParallel
    from shardwise.training.parts import TrainParts


class Steps(Protocol):
    """What the loop uses of the engine: its forward, backward and step calls, its
    context-parallel scope and the ``loss_fn`` given to ``initialize``."""

    context: ContextParallel
    loss_fn: Any

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any: ...

    def backward(self, loss: torch.Tensor) -> torch.Tensor: ...

    def step(self) -> None: ...


def loss_of(engine: Steps, batch: Any) -> torch.Tensor:
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


def _call(engine: Steps, inputs: Any) -> Any:
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


def _dp_mean(parts: TrainParts, total: torch.Tensor) -> torch.Tensor:
    total /= parts.batch.gradient_accumulation_steps
    comm.all_reduce(total, group=parts.mesh.dp_cp_group)  # context ranks: other tokens
    return total / parts.mesh.topology.dp_cp


class MicroBatchLoop:
    """GAS micro-batches through the engine's forward / backward / step (the module doc)."""

    def __init__(self, engine: Steps) -> None:
        self.engine = engine

    def train_batch(
        self, parts: TrainParts, data_iter: Iterator | None, update: Callable[[], None]
    ) -> torch.Tensor:
        """``engine.step()`` updates at the last micro-batch: ``update`` is not called here."""
        data_iter = parts.data(data_iter)
        total = torch.zeros(())
        for _ in range(parts.batch.gradient_accumulation_steps):
            loss = loss_of(self.engine, next(data_iter))
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach().float().cpu()
        return _dp_mean(parts, total)

    @torch.no_grad()
    def eval_batch(self, parts: TrainParts, data_iter: Iterator, **kwargs: Any) -> torch.Tensor:
        if kwargs:
            raise EngineError(f"eval_batch() got {sorted(kwargs)}: only pipelines take options")
        total = torch.zeros(())
        for _ in range(parts.batch.gradient_accumulation_steps):
            total += loss_of(self.engine, next(data_iter)).float().cpu()
        return _dp_mean(parts, total)
