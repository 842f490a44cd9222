"""DeepSpeed's monitors, timers and profilers, as the engine sees them: one ``Monitor``.

The engine builds it from its parts (``Monitor.build(parts, memory)``: training/parts.py) and
calls four things: ``section(name)`` around its forward (``"fwd"``), backward (``"bwd"``,
``"bwd_inner"``, ``"bwd_allreduce"``) and update (``"step"``); ``add_loss`` after each backward;
``after_step(parts, grad_norm, ...)`` after each optimizer step; ``write_step`` for a pipeline's
loss. Everything off costs one attribute test per call (``section`` hands back a shared no-op
context). What is on depends on the config:

- ``tensorboard``, ``csv_monitor``, ``wandb``, ``comet`` (writers.py), on rank 0: after each
  step, DeepSpeed's events against the number of samples trained so far:
      Train/Samples/train_loss   the step's loss (rank 0's mean over its micro-batches)
      Train/Samples/lr           the first parameter group's learning rate
      Train/Samples/loss_scale   the fp16 loss scale (with fp16 only)
  and with ``wall_clock_breakdown`` Train/Samples/elapsed_time_ms_{forward,backward,...}.
- ``wall_clock_breakdown`` (timers.py): the sections are timed; every ``steps_per_print``
  steps (every step when it is null, DeepSpeed's default) rank 0 logs
  ``time (ms) | fwd: .. | bwd: .. | ...`` (the mean per step).
- ``memory_breakdown``: as often, rank 0 logs ``engine.memory_breakdown()``.
- ``flops_profiler`` (flops.py): rank 0's forward at ``profile_step`` is profiled, the summary
  printed after that step.
- ``comms_logger`` (comms.py): configured process-wide in ``shardwise.comm`` (as DeepSpeed's
  engine configures ``deepspeed.comm``); ``shardwise.comm.log_summary()`` prints the table.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from shardwise import comm
from shardwise.monitor.comms import convert_size
from shardwise.monitor.flops import FlopsProfiler
from shardwise.monitor.profile_report import profile_report
from shardwise.monitor.timers import WallClock
from shardwise.monitor.writers import Event, enabled_writers

if TYPE_CHECKING:  # annotations only
    from shardwise.monitor.flops import FlopsProfiler
    from shardwise.monitor.timers import WallClock
    from shardwise.training.parts import TrainParts

logger = logging.getLogger("shardwise")
_OFF = contextlib.nullcontext()


def step_events(loss: float, lr: float, samples: int, loss_scale: float | None) -> list[Event]:
    """DeepSpeed's events after one optimizer step (the module doc)."""
    events = [("Train/Samples/train_loss", loss, samples), ("Train/Samples/lr", lr, samples)]
    if loss_scale is not None:
        events.append(("Train/Samples/loss_scale", loss_scale, samples))
    return events


def progress_line(steps: int, loss: float, seconds: float, batch: int) -> str:
    """DeepSpeed's ``train_batch`` line, logged every ``steps_per_print`` steps."""
    return (
        f"steps: {steps} loss: {loss:0.4f} iter time (s): {seconds:0.3f} "
        f"samples/sec: {batch / seconds:0.3f}"
    )


def step_line(parts: TrainParts, norm: float | None) -> str:
    """The engine's own line every ``steps_per_print`` steps: step, skips, LR, norm, scale."""
    lrs = ", ".join(f"{lr:.3g}" for lr in parts.lrs())
    counters = parts.counters
    return (
        f"step={counters.global_steps} skipped={counters.skipped_steps} lr=[{lrs}] "
        f"grad_norm={norm if norm is None else f'{norm:.4g}'} "
        f"loss_scale={parts.scaler.scale:g}"
    )


def memory_line(breakdown: dict[str, int]) -> str:
    """``engine.memory_breakdown()`` on one line: ``memory | params: 6.77 KB | ...``."""

    return " | ".join(["memory", *(f"{k}: {convert_size(v)}" for k, v in breakdown.items())])


class Monitor:
    """What the config turned on (module doc); built by the engine with ``build``."""

    def __init__(
        self,
        writers: list[Any],
        clock: WallClock | None = None,
        profiler: FlopsProfiler | None = None,
    ) -> None:
        self.writers = writers
        self.clock = clock  # timers.WallClock with wall_clock_breakdown
        self.profiler = profiler  # flops.FlopsProfiler with flops_profiler, rank 0
        self.step_loss = 0.0  # the mean loss of this step's micro-batches so far
        self.parts: TrainParts | None = None  # the run's (profile_step is read off its counters)
        self.memory: Callable[[], dict[str, int]] = dict  # the engine's memory_breakdown

    @classmethod
    def build(cls, parts: TrainParts, memory: Callable[[], dict[str, int]]) -> Monitor:
        """Writers and profiler on rank 0; the clock on every rank (each times its own work,
        rank 0 reports); the comms logger configured. ``memory``: the breakdown the
        ``memory_breakdown`` key logs."""
        config, rank0 = parts.config, parts.mesh.rank == 0
        comm.configure(config)  # on, or off again, whatever an earlier engine set
        clock = profiler = None
        if config.wall_clock_breakdown:
            clock = WallClock()
        if config.flops_profiler.enabled and rank0:
            profiler = FlopsProfiler(parts.module, config.flops_profiler)
        monitor = cls(enabled_writers(config) if rank0 else [], clock, profiler)
        monitor.parts, monitor.memory = parts, memory
        return monitor

    def times_sections(self) -> bool:
        """Whether ``section`` does anything (a pipeline's schedule then calls it too)."""
        return self.clock is not None or self.profiler is not None

    # ------------------------------------------------------------------ sections
    def section(self, name: str) -> Any:
        """A context timing ``name`` (and profiling the forward at ``profile_step``)."""
        if name == "fwd" and self.profiler is not None and self._profiling():
            return self._profiled_forward()
        return self.clock.section(name) if self.clock is not None else _OFF

    def _profiling(self) -> bool:
        steps = self.parts.counters.global_steps if self.parts is not None else None
        return steps == self.profiler.cfg.profile_step

    @contextlib.contextmanager
    def _profiled_forward(self) -> Iterator[None]:
        self.profiler.start()  # restarts at each micro-batch: the last one is kept
        try:
            with self.clock.section("fwd") if self.clock is not None else _OFF:
                yield
        finally:
            self.profiler.stop()

    # ------------------------------------------------------------------ events
    def add_loss(self, loss: torch.Tensor, micro_batches: int) -> None:
        """One micro-batch's loss (read only when a writer will use it: .item() syncs)."""
        if self.writers:
            self.step_loss += loss.detach().float().item() / micro_batches

    def write_step(
        self, loss: float | None, lr: float, samples: int, loss_scale: float | None
    ) -> None:
        """The events of the step just taken (``loss`` None: the micro-batches' mean)."""
        if self.writers:
            value = self.step_loss if loss is None else loss
            self.write_events(step_events(value, lr, samples, loss_scale))
        self.step_loss = 0.0

    def write_events(self, events: list[Event]) -> None:
        for writer in self.writers:
            writer.write_events(events)

    # ------------------------------------------------------------------ after a step
    def after_step(self, parts: TrainParts, grad_norm: float | None, events: bool) -> None:
        """Events (``events`` False with a pipeline, which writes its own after the schedule:
        its loss is known then), and on rank 0 every ``steps_per_print`` steps: the step line,
        the timers, the memory; and the flops profile after ``profile_step``."""
        samples, steps = parts.counters.global_samples, parts.counters.global_steps
        if self.clock is not None:
            self.clock.end_step()
            self.write_events(self.clock.events(samples))
        if events:
            scale = parts.scaler.scale if parts.config.fp16.enabled else None
            self.write_step(None, parts.lrs()[0], samples, scale)
        if self.profiler is not None and steps == self.profiler.cfg.profile_step + 1:
            self.print_profile(parts)
        every = parts.config.steps_per_print  # None (DeepSpeed's default): breakdowns every step
        if every is not None and steps % every:
            return
        line = self.clock.line() if self.clock is not None else None  # resets every rank's
        if parts.mesh.rank != 0:
            return
        if every is not None:
            logger.info(step_line(parts, grad_norm))
        if line is not None:
            logger.info(line)
        if parts.config.memory_breakdown:
            logger.info(memory_line(self.memory()))

    def print_profile(self, parts: TrainParts) -> None:
        """The flops profile to stdout, or to ``flops_profiler.output_file``."""
        text = profile_report(self.profiler, parts, self.clock)
        path = self.profiler.cfg.output_file
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
