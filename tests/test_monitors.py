"""DeepSpeed's monitors write what DeepSpeed writes, read back by TensorBoard's own reader.

A run with ``tensorboard`` and ``csv_monitor`` enabled trains a few steps (plain, with
accumulation, on two data ranks, fp16, and a pipeline); the event files must hold
Train/Samples/train_loss, Train/Samples/lr (and loss_scale with fp16) at steps = samples
trained, with the values the engine reports: the loss of rank 0's micro-batches, the LR.
"""

from __future__ import annotations

import csv

import pytest
import torch
from harness import run_distributed
from models import make_data, make_model
from pipe_models import micro_batches, pipeline_module

import shardwise
from shardwise.config.monitor import MonitorConfig
from shardwise.monitor.writers import CsvWriter

pytest.importorskip("tensorboard", reason="the TensorBoard reader comes with the dev extra")

MB = 4
SCHED = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.1}}


def _train(out: str, gas: int, extra: dict) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": SCHED,
        "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"},
        **extra,
    }
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    x, y = make_data(64)
    dtype = next(engine.module.parameters()).dtype
    losses, lrs = [], []
    for step in range(3):
        total = 0.0
        for j in range(gas):
            rows = slice((step * gas + j) * MB, (step * gas + j + 1) * MB)
            loss = torch.nn.functional.mse_loss(engine(x[rows].to(dtype)).float(), y[rows])
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        losses.append(total)
        lrs.append(engine.get_lr()[0])
    return {"losses": losses, "lrs": lrs, "samples": engine.train_batch_size()}


def _train_pipeline(out: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
    }
    engine, *_ = shardwise.initialize(model=pipeline_module("mlp", 2), config=config)
    batches = micro_batches("mlp", engine, MB, 2, 3)
    losses = [engine.train_batch(batches).item() for _ in range(3)]
    return {"losses": losses, "lrs": [0.1] * 3, "samples": engine.train_batch_size()}


def read_tensorboard(path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


CASES = {
    "plain": (1, 1, {}),
    "gas2": (1, 2, {}),
    "dp2": (2, 1, {}),
    "fp16": (1, 1, {"fp16": {"enabled": True, "initial_scale_power": 4}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tensorboard_and_csv_hold_deepspeeds_events(case, tmp_path):
    world, gas, extra = CASES[case]
    got = run_distributed(_train, world, str(tmp_path), gas, extra)[0]
    events = read_tensorboard(tmp_path / "tb")
    steps = [got["samples"] * (k + 1) for k in range(3)]
    want = {"Train/Samples/train_loss": got["losses"], "Train/Samples/lr": got["lrs"]}
    if case == "fp16":
        want["Train/Samples/loss_scale"] = [16.0] * 3
    assert set(events) == set(want), f"{case}: tags {sorted(events)}"
    for tag, values in want.items():
        assert [s for s, _ in events[tag]] == steps, f"{case}: {tag} steps"
        assert [v for _, v in events[tag]] == pytest.approx(values, rel=1e-6), f"{case}: {tag}"
    with open(tmp_path / "csv" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"], f"{case}: csv header"
    assert [int(r[0]) for r in rows[1:]] == steps, f"{case}: csv steps"
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(got["losses"]), f"{case}: csv"


def test_a_pipeline_writes_its_loss_too(tmp_path):
    got = run_distributed(_train_pipeline, 2, str(tmp_path))[0]
    events = read_tensorboard(tmp_path / "tb")
    loss = events["Train/Samples/train_loss"]
    assert [s for s, _ in loss] == [got["samples"] * (k + 1) for k in range(3)]
    assert [v for _, v in loss] == pytest.approx(got["losses"], rel=1e-6)


# DeepSpeed's csvMonitor (deepspeed/monitor/csv_monitor.py, 0.19.8): the file is the event name
# with "/" and " " made "_"; the header is "step" and the name's last "/" part.
CSV_NAMES = [
    ("Train/Samples/train_loss", "Train_Samples_train_loss.csv", "train_loss"),
    ("Train/Samples/lr", "Train_Samples_lr.csv", "lr"),
    ("Train/Samples/elapsed_time_ms_forward", "Train_Samples_elapsed_time_ms_forward.csv",
     "elapsed_time_ms_forward"),
    ("eval loss", "eval_loss.csv", "eval loss"),
    ("Eval/top 1", "Eval_top_1.csv", "top 1"),
]  # fmt: skip


@pytest.mark.parametrize("tag, name, header", CSV_NAMES, ids=[t for t, _, _ in CSV_NAMES])
def test_csv_monitor_writes_deepspeeds_file_names_and_columns(tmp_path, tag, name, header):
    writer = CsvWriter(MonitorConfig(enabled=True, output_path=str(tmp_path), job_name="job"))
    writer.write_events([(tag, 0.5, 4)])
    writer.write_events([(tag, 0.25, 8)])
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == [name], tag
    with open(tmp_path / "job" / name, newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["step", header], ["4", "0.5"], ["8", "0.25"]], tag
