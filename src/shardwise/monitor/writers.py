"""Where the events go: TensorBoard, CSV files, Weights & Biases, Comet (DeepSpeed's four
monitors). Each is built on rank 0 only, when its block is enabled; the optional packages are
imported then, and a missing one is an ImportError naming the extra that installs it."""

from __future__ import annotations

import csv
import os
from typing import Any

from shardwise.config.monitor import CometConfig, MonitorConfig, WandbConfig

Event = tuple[str, float, int]  # (tag, value, step)


def _require(module: str, block: str, extra: str) -> Any:
    import importlib  # noqa: PLC0415 - optional dependencies, imported when enabled

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f'the "{block}" config block needs the {module} package: '
            f"pip install shardwise[{extra}] (or set {block}.enabled to false)"
        ) from e


class TensorBoardWriter:
    """Events into TensorBoard event files (read back by TensorBoard itself)."""

    def __init__(self, cfg: MonitorConfig) -> None:
        _require("tensorboard", "tensorboard", "tensorboard")  # torch's writer needs it
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional dependencies, imported when enabled

        self.writer = SummaryWriter(log_dir=os.path.join(cfg.output_path, cfg.job_name))

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()


class CsvWriter:
    """DeepSpeed's csvMonitor: one CSV file per event, named after the whole event name with
    "/" and " " made "_" (``Train/Samples/train_loss`` -> ``Train_Samples_train_loss.csv``),
    holding a ``step,<last part of the name>`` header and ``step,value`` rows."""

    def __init__(self, cfg: MonitorConfig) -> None:
        self.dir = os.path.join(cfg.output_path, cfg.job_name)
        os.makedirs(self.dir, exist_ok=True)

    @staticmethod
    def file_name(tag: str) -> str:
        """``Train/Samples/train_loss`` -> ``Train_Samples_train_loss.csv``, as DeepSpeed."""
        return tag.replace("/", "_").replace(" ", "_") + ".csv"

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            path = os.path.join(self.dir, self.file_name(tag))
            # DeepSpeed heads a file again each time a new monitor appends to it (a resumed
            # run); the header goes only at the top of a new file here.
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                out = csv.writer(f)
                if new:
                    out.writerow(["step", tag.rsplit("/", 1)[-1]])
                out.writerow([step, value])


class WandbWriter:
    """``wandb.init(project=, group=, entity=team)``, then ``wandb.log({tag: value},
    step=samples)`` per event, as DeepSpeed's WandbMonitor. ``WANDB_MODE=offline`` keeps the run
    on disk (``wandb/offline-run-*``); wandb finishes the run at exit (or ``wandb.finish()``)."""

    def __init__(self, cfg: WandbConfig) -> None:
        self.wandb = _require("wandb", "wandb", "wandb")
        self.wandb.init(project=cfg.project, group=cfg.group, entity=cfg.team)

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            self.wandb.log({tag: value}, step=step)


class CometWriter:
    """``comet_ml.start(...)`` with the block's keys, then each event as a metric at most once
    per ``samples_log_interval`` samples (DeepSpeed's CometMonitor and its scheduler)."""

    def __init__(self, cfg: CometConfig) -> None:
        comet_ml = _require("comet_ml", "comet", "comet")
        self.experiment = comet_ml.start(
            api_key=cfg.api_key,
            project=cfg.project,
            workspace=cfg.workspace,
            experiment_key=cfg.experiment_key,
            mode=cfg.mode,
            online=cfg.online,
        )
        if cfg.experiment_name is not None:
            self.experiment.set_name(cfg.experiment_name)
        self.interval = cfg.samples_log_interval
        self.last: dict[str, int] = {}  # tag -> samples when last logged

    def write_events(self, events: list[Event]) -> None:
        for tag, value, step in events:
            if tag in self.last and step - self.last[tag] < self.interval:
                continue
            self.last[tag] = step
            self.experiment.log_metric(tag, value, step=step)


KINDS = {
    "tensorboard": TensorBoardWriter,
    "csv_monitor": CsvWriter,
    "wandb": WandbWriter,
    "comet": CometWriter,
}


def enabled_writers(config: Any) -> list[Any]:
    """A writer for each enabled monitor block (call on rank 0 only)."""
    return [cls(getattr(config, key)) for key, cls in KINDS.items() if getattr(config, key).enabled]
