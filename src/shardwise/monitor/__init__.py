"""DeepSpeed's monitors: the events the engine writes after each optimizer step, on rank 0.

Events are DeepSpeed's, with the number of samples trained so far as the x axis:

    Train/Samples/train_loss   the step's loss (rank 0's mean over its micro-batches)
    Train/Samples/lr           the first parameter group's learning rate
    Train/Samples/loss_scale   the fp16 loss scale (with fp16 only)

``tensorboard`` writes event files through TensorBoard's own writer
(``torch.utils.tensorboard``, the ``tensorboard`` extra); ``csv_monitor`` writes one CSV file
per event (``train_loss.csv``: ``step,train_loss`` rows). Both under ``output_path/job_name``.
"""

from __future__ import annotations

import csv
import os
from typing import Any, Protocol

import torch

from shardwise.config.monitor import MonitorConfig

Event = tuple[str, float, int]  # (tag, value, step)


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


class Writer(Protocol):
    def write_events(self, events: list[Event]) -> None: ...


class TensorBoardWriter:
    """Events into TensorBoard event files (read back by TensorBoard itself)."""

    def __init__(self, cfg: MonitorConfig) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise ImportError(
                'the "tensorboard" config block needs TensorBoard: pip install shardwise[tensorboard]'
            ) from e
        self.writer = SummaryWriter(log_dir=os.path.join(cfg.output_path, cfg.job_name))

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()


class CsvWriter:
    """One CSV file per event, named after the tag's last part."""

    def __init__(self, cfg: MonitorConfig) -> None:
        self.dir = os.path.join(cfg.output_path, cfg.job_name)
        os.makedirs(self.dir, exist_ok=True)

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            name = tag.rsplit("/", 1)[-1]
            path = os.path.join(self.dir, f"{name}.csv")
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                out = csv.writer(f)
                if new:
                    out.writerow(["step", name])
                out.writerow([step, value])


class Monitor:
    """The enabled writers (none on ranks other than 0, or when no block is on: then every
    call is a no-op); ``write_events`` fans out to each."""

    def __init__(self, writers: list[Writer]) -> None:
        self.writers = writers
        self.step_loss = 0.0  # the mean loss of this step's micro-batches so far

    @classmethod
    def from_config(cls, config: Any, rank: int) -> Monitor:
        kinds = {"tensorboard": TensorBoardWriter, "csv_monitor": CsvWriter}
        blocks = {k: getattr(config, k) for k in kinds}
        return cls([kinds[k](b) for k, b in blocks.items() if b.enabled] if rank == 0 else [])

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
