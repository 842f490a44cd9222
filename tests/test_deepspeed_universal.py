"""A DeepSpeed universal folder that cannot be mapped fully is refused when it is opened, before
any engine changes (checkpoint/foreign/deepspeed_universal.py). The folder is written by
shardwise in one process (format="deepspeed-universal"), then damaged; that real DeepSpeed
writes and reads such folders is test_deepspeed_import.py's and test_deepspeed_export.py's
subject.
"""

import os

import pytest
import torch

import shardwise
from shardwise.checkpoint.foreign.deepspeed_write import write
from shardwise.checkpoint.foreign.detect import open_checkpoint
from shardwise.checkpoint.manifest import CheckpointError


@pytest.fixture
def folder(tmp_path) -> str:
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = shardwise.initialize(model=torch.nn.Linear(2, 2), config=cfg)
    engine.backward(engine(torch.ones(1, 2)).sum())
    engine.step()
    engine.save_checkpoint(str(tmp_path), format="deepspeed-universal")
    return str(tmp_path / "global_step1")


def _tensor_parallel_entry(path: str) -> None:
    file = f"{path}/zero/weight/exp_avg.pt"
    saved = torch.load(file, weights_only=True)
    write(saved | {"vocab_tensor": True}, file)  # what a tensor-parallel source adds


def _no_master(path: str) -> None:
    os.remove(f"{path}/zero/bias/fp32.pt")


def _other_shape(path: str) -> None:
    write({"param": torch.zeros(3), "cat_dim": 0}, f"{path}/zero/bias/exp_avg_sq.pt")


def test_an_intact_folder_opens(folder):
    with open_checkpoint(folder) as reader:
        assert "optim/exp_avg_sq/bias" in reader.names(), reader.names()
        assert reader.describe()["layout"]["zero_stage"] == 2


@pytest.mark.parametrize(
    "damage, message",
    [
        (_tensor_parallel_entry, r"exp_avg.pt: entries \['vocab_tensor'\].*tensor-parallel"),
        (_no_master, r"bias/fp32.pt is missing"),
        (_other_shape, r"exp_avg_sq.pt: holds \(3,\), the model file says shape \(2,\)"),
    ],
    ids=["tensor-parallel entry", "no fp32.pt", "another shape"],
)
def test_a_folder_it_cannot_map_is_refused_when_opened(folder, damage, message):
    damage(folder)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(folder)
