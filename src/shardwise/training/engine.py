"""The training engine: DeepSpeed's call surface, composed of strategy objects.

The engine itself holds no parallelism logic. It owns the step bookkeeping (micro steps,
accumulation boundary, global steps, skipped steps) and delegates to a gradient strategy
``self.strategy`` (parallel/strategy_contract.py: ``GradientStrategy``, the whole contract, and
parallel/strategy_table.py: the table that picks one from the config), ``self.batch_strategy``
for whole batches (``train_batch`` / ``eval_batch``: batch_loop.MicroBatchLoop,
or the pipeline's runner, which also makes ``forward/backward/step`` refuse), and to
``self.scaler`` (precision.LossScaler) for fp16's loss scale. The update:

    norm_S = ||S g||  (one all-reduce; inf/nan anywhere = overflow on every rank)
    overflow -> skip, lower S;  else coef = clip(norm_S / S) / S -> strategy.step(coef)

One accumulation cycle is GAS times ``loss = engine(batch); engine.backward(loss);
engine.step()``: backward scales by 1/GAS and reduces, and step updates, on the last only.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.errors import EngineError
from shardwise.monitor import Monitor, progress_line
from shardwise.monitor.memory import breakdown
from shardwise.parallel import clip
from shardwise.parallel.context.scope import ContextParallel
from shardwise.parallel.moe.experts import global_state
from shardwise.parallel.tensor.consolidate import consolidate_tensor_parallel
from shardwise.precision import LossScaler, compute_dtype
from shardwise.training.accessors import PART_FIELDS, EngineAccessors
from shardwise.training.batch_loop import MicroBatchLoop
from shardwise.training.checkpoints import held, load, save
from shardwise.training.checkpoints.autosave import AutoSave
from shardwise.training.checkpoints.replica_watch import ReplicaWatch
from shardwise.training.compiling import CompileMethods
from shardwise.training.counters import CounterField, TrainingCounters
from shardwise.training.parts import BatchStrategy, TrainParts

if TYPE_CHECKING:  # annotations only
    from shardwise.checkpoint.async_save import SaveHandle
    from shardwise.config import BatchSizes, Config
    from shardwise.parallel.pipeline.train_batch import PipelineRunner
    from shardwise.parallel.strategy_contract import GradientStrategy
    from shardwise.topology import ProcessMesh
    from shardwise.training.data_loader import DistributedDataLoader

logger = logging.getLogger("shardwise")


class Engine(EngineAccessors, CompileMethods, nn.Module):
    """Wraps a model; ``engine(*inputs)`` runs it, ``backward``/``step`` train it. Its parts
    (``engine.parts``: parts.py) are what it hands to the modules that work for it."""

    # DeepSpeed's counter names, views of ``self.counters`` (counters.py)
    micro_steps, global_steps = CounterField(), CounterField()
    global_samples, skipped_steps = CounterField(), CounterField()

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any,
        strategy: GradientStrategy,
        mesh: ProcessMesh,
        config: Config,
        batch: BatchSizes,
        training_dataloader: DistributedDataLoader | None = None,
        loss_fn: Callable[..., Any] | None = None,
        scaler: LossScaler | None = None,
        pipeline: PipelineRunner | None = None,
    ) -> None:
        super().__init__()
        self.parts = TrainParts(
            module,
            optimizer,
            lr_scheduler,
            strategy,
            mesh,
            config,
            batch,
            scaler if scaler is not None else LossScaler(),
            TrainingCounters(),  # saved and loaded whole by checkpoints
            ContextParallel.from_mesh(config, mesh),  # shardwise.attention's ranks
            training_dataloader,
            loss_fn,
        )
        self.module = module
        self.pipeline = pipeline  # parallel/pipeline/train_batch.py when pipeline stages > 1
        self.batch_strategy: BatchStrategy = pipeline or MicroBatchLoop(self)
        self._boundary_override: bool | None = None
        self._in_no_sync = False
        self._global_grad_norm: float | None = None
        self._step_applied = True
        self._backwards = 0  # engine.backward calls since the last step()
        # DeepSpeed's monitors, timers, profilers; a pipeline's schedule timed too
        self.monitor = Monitor.build(self.parts, self.memory_breakdown)
        if pipeline is not None and self.monitor.times_sections():
            pipeline.executor.section = self.monitor.section
        self.replicas = ReplicaWatch(config.checkpoint.replica_check_interval)
        self.autosave = AutoSave(config.checkpoint)  # save_dir: interval saves, SIGTERM

    def __setattr__(self, name: str, value: Any) -> None:
        # a part goes to ``self.parts`` whatever its type (nn.Module's own __setattr__ would
        # register an nn.Module loss_fn as a submodule, past the PartField)
        if name in PART_FIELDS and "parts" in self.__dict__:
            setattr(self.parts, name, value)
        else:
            super().__setattr__(name, value)

    def get_global_grad_norm(self) -> float | None:
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    # ------------------------------------------------------------------ training
    def _refuse_in_pipeline(self, call: str) -> None:
        if self.pipeline is not None:
            raise EngineError(self.pipeline.refusal(call))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._refuse_in_pipeline("forward()")
        dtype = compute_dtype(self.config)
        if dtype != torch.float32:
            # 16-bit weights need 16-bit inputs; integer inputs (token ids) pass unchanged.
            inputs = tuple(_cast(x, dtype) for x in inputs)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with self.monitor.section("fwd"), self.context.forward():
            return self.module(*inputs, **kwargs)

    def shard_sequence(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``tensor`` along ``dim`` under context parallelism (chunks
        r and 2cp-1-r of 2cp); the tensor itself without it. ``train_batch`` does it itself."""
        return self.context.shard(tensor, dim)

    def sequence_positions(self, seq_len: int) -> torch.Tensor:
        """Global positions of this rank's tokens of a ``seq_len``-token sequence."""
        return self.context.positions(seq_len, device=self.device)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary

    def backward(
        self,
        loss: torch.Tensor,
        release_loss: bool = False,
        retain_graph: bool = False,
        scale_wrt_gas: bool = True,
    ) -> torch.Tensor:
        """Backpropagate ``loss / GAS``; reduce gradients at the accumulation boundary."""
        self._refuse_in_pipeline("backward()")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise EngineError(
                "engine.backward(loss) needs a scalar loss tensor; "
                f"got {type(loss).__name__} of shape {getattr(loss, 'shape', None)}"
            )
        self.autosave.step_started()  # a SIGTERM from here on is read at the step's end
        sync = self.is_gradient_accumulation_boundary() and not self._in_no_sync
        scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        if self.scaler.scale != 1.0:
            scaled = scaled * self.scaler.scale
        self.replicas.before_backward(self.parts, sync)  # replicas agree (replica_check_interval)
        with self.monitor.section("bwd"):
            self.strategy.before_backward(sync)
            with self.monitor.section("bwd_inner"), self.context.active():  # recompute too
                scaled.backward(retain_graph=retain_graph)
            with self.monitor.section("bwd_allreduce"):
                self.strategy.after_backward(sync)
        self._backwards += 1
        self.monitor.add_loss(loss, self.gradient_accumulation_steps())
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Update at the accumulation boundary: clip, optimizer step, scheduler step, zero."""
        self._refuse_in_pipeline("step()")
        if self._in_no_sync:
            raise EngineError("engine.step() inside engine.no_sync(): leave the block first")
        if self.optimizer is None:
            raise EngineError(
                "must provide optimizer during init in order to use step: pass optimizer= to "
                'shardwise.initialize or an "optimizer" block in the config'
            )
        if not self._backwards:
            # Nothing to apply: counting a step would still move the LR schedule (DeepSpeed does).
            logger.warning(
                "engine.step() with no engine.backward(loss) since the last step: skipped"
            )
            return
        self._backwards = 0
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self.apply_update(lr_kwargs)
        self.micro_steps += 1
        self._boundary_override = None
        if boundary:
            self.autosave.after_step(self)  # may save; after a SIGTERM, saves and exits

    def apply_update(self, lr_kwargs: dict | None = None) -> None:
        """The update at an accumulation boundary (engine.step's, and the pipeline's)."""
        with self.monitor.section("step"):
            self._update(lr_kwargs)
        # events, the steps_per_print lines, the flops profile
        self.monitor.after_step(self.parts, self._global_grad_norm, self.pipeline is None)

    def _update(self, lr_kwargs: dict | None) -> None:
        scale = self.scaler.scale
        # The norm costs a pass over the gradient and an all-reduce: only when clipping or the
        # fp16 overflow check needs it (as DeepSpeed; get_global_grad_norm() is None then).
        norm, measured = 0.0, False
        if self.gradient_clipping() > 0 or self.scaler.dynamic or scale != 1.0:
            measured = True
            norm = clip.global_grad_norm(
                self.strategy.owned_grads(),
                self.strategy.norm_group,
                self.mesh.model_parallel_group if self.mesh.model_parallel_size > 1 else None,
            )
        overflow = not math.isfinite(norm)
        self._step_applied = not overflow
        if overflow:
            logger.info(
                "step %d: gradient overflow, skipped (loss scale %g)", self.global_steps, scale
            )
        else:
            self._global_grad_norm = norm / scale if measured else None
            coef = clip.clip_coefficient(norm / scale, self.gradient_clipping()) / scale
            self.strategy.step(self.optimizer, coef)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        self.scaler.update(overflow)
        self.zero_grad()
        self.counters.count_update(self.train_batch_size(), skipped=overflow)

    def _write_events(self, loss: float | None = None) -> None:
        scale = self.scaler.scale if self.config.fp16.enabled else None
        self.monitor.write_step(loss, self.get_lr()[0], self.global_samples, scale)

    def zero_grad(self) -> None:
        self.strategy.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside this block accumulates locally and communicates nothing."""
        if self._in_no_sync:
            raise EngineError("engine.no_sync() is already active: it does not nest")
        if not self.strategy.supports_no_sync:
            raise EngineError(
                "no_sync is incompatible with gradient partitioning (ZeRO stage >= 2): every "
                "micro-step must reduce-scatter; use gradient_accumulation_steps instead"
            )
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    # ------------------------------------------------------------------ whole batches
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over GAS micro-batches from ``data_iter``; the mean loss,
        averaged over the data-parallel group (the same value on every rank). Run by the
        batch strategy: batch_loop.MicroBatchLoop, or the pipeline's schedule. Every
        ``steps_per_print`` steps rank 0 logs DeepSpeed's line: steps, loss, time, samples/s."""
        start = time.perf_counter()
        self.autosave.step_started()
        self.train()
        loss = self.batch_strategy.train_batch(self.parts, data_iter, self.apply_update)
        if self.pipeline is not None:
            self._write_events(loss.item())
            self.replicas.after_batch(self.parts)
            self.autosave.after_step(self)
        if self.mesh.rank == 0 and (n := self.steps_per_print()) and self.global_steps % n == 0:
            took = time.perf_counter() - start
            logger.info(
                progress_line(self.global_steps, loss.item(), took, self.train_batch_size())
            )
        return loss

    def eval_batch(self, data_iter: Iterator | None, **kwargs: Any) -> Any:
        """The mean loss of GAS micro-batches without training, averaged over data ranks.
        With a pipeline: ``return_logits`` and ``num_micro_batches`` as DeepSpeed's."""
        was_training = self.training
        self.eval()
        try:
            return self.batch_strategy.eval_batch(self.parts, data_iter, **kwargs)
        finally:
            self.train(was_training)

    # ------------------------------------------------------------------ state
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state dict with the original keys, on CPU, identical on every rank."""
        state = self.strategy.consolidated_state_dict(self.module)
        if self.mesh.topology.tp > 1:
            state = consolidate_tensor_parallel(state, self.module, self.mesh.tp_group)
        if self.pipeline is not None:
            state = self.pipeline.consolidated_state_dict(state)
        return global_state(self.module, state)  # MoE: every expert, ep_size=1 names

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        return self.consolidated_state_dict()

    # ------------------------------------------------------------------ checkpoints
    # DeepSpeed's calls; the work is in checkpoints/save.py, load.py (any layout loads any other).
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | int | None = None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        async_save: bool = False,
        format: str = "shardwise",  # noqa: A002 - the public argument's name
    ) -> bool | SaveHandle:
        """Write ``save_dir/<tag>`` (default ``global_step<N>``); every rank must call it.
        ``async_save``: copy now, write in the background; returns the save's handle.
        ``format``: "shardwise" (default), "deepspeed", "deepspeed-universal" (DeepSpeed 0.19
        resumes it at any data-parallel size) or "dcp" (torch DCP): save_foreign.py."""
        return save.save_checkpoint(
            self.parts,
            self.autosave,
            save_dir,
            tag,
            client_state,
            save_latest,
            exclude_frozen_parameters,
            async_save,
            format,
        )

    def wait_for_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight (if any); raise its error if it failed."""
        if self.autosave.writer is not None:
            self.autosave.writer.wait()

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | int | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict | None]:
        """``(load_path, client_state)``, or ``(None, None)`` without ``latest`` nor tag."""
        options = (load_module_strict, load_optimizer_states, load_lr_scheduler_states)
        path, client = load.load_checkpoint(self.parts, load_dir, tag, *options, load_module_only)
        if path is not None:  # a later save there may replace newer checkpoints (rotation.py)
            self.autosave.loaded_from = os.path.abspath(load_dir)
        return path, client

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """The consolidated model as one file; safetensors content whatever the name."""
        state = self.consolidated_state_dict()  # every rank: ZeRO-3 and pipelines gather
        return save.save_16bit_model(
            self.parts, state, save_dir, save_filename, exclude_frozen_parameters
        )

    def load_module_state_dict(self, checkpoint: dict | str, strict: bool = True) -> Any:
        """Load a whole-model state dict (the user's keys) into this layout; or Hugging Face
        safetensors weights (a directory with ``model.safetensors.index.json`` and its shards,
        or a ``.safetensors`` file), each rank reading only the slices it holds: returns that
        reader then (its ``bytes_read``)."""
        if isinstance(checkpoint, (str, os.PathLike)):
            return held.load_safetensors(self.parts, os.fspath(checkpoint), strict)
        return held.load_module_state_dict(self.parts, checkpoint, strict)

    def destroy(self) -> None:
        """DeepSpeed's: take the engine's hooks off the model, so another engine can train it."""
        self.strategy.close()
        self.autosave.close()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients, optimizer states (master weights
        included), communication buffers and checkpoint staging, from the live tensors."""
        writer = self.autosave.writer
        staging = writer.staging_bytes() if writer is not None else 0
        return breakdown(self.module, self.optimizer, self.strategy, staging)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x
