"""Saves in other formats (``save_checkpoint(format="deepspeed" | "deepspeed-universal" |
"dcp")``) are stored as shardwise's own are (storage.py, rotation.py, lock.py): the directory's
lock, no save below the directory's later steps, written into a hidden directory and renamed
into place only once every file is complete, ``keep_last`` rotation by step. Each carries
``shardwise_save.json`` (its format and step) for the last two, since it has no manifest.

One process, a tiny ZeRO-1 engine (every format writes from it); no DeepSpeed needed: that
DeepSpeed loads these files is test_deepspeed_export.py's subject.
"""

import json
import os

import pytest
import torch

import shardwise
from shardwise.checkpoint.foreign import deepspeed_write
from shardwise.checkpoint.lock import LOCK
from shardwise.checkpoint.manifest import CheckpointError

FORMATS = ["deepspeed", "deepspeed-universal", "dcp"]
LATEST = {"deepspeed": "latest", "deepspeed-universal": "latest_universal", "dcp": "latest"}


def _engine(keep_last: int | None = None, load_universal: bool = False):
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
        "checkpoint": {"load_universal": load_universal},
    }
    if keep_last is not None:
        cfg["checkpoint"]["keep_last"] = keep_last
    engine, *_ = shardwise.initialize(model=torch.nn.Linear(2, 2), config=cfg)
    return engine


def _step(engine, steps: int = 1) -> None:
    for _ in range(steps):
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()


def _listing(save_dir) -> list[str]:
    """Everything but the lock: hidden leftovers (.tmp-, .staging) would show."""
    return sorted(n for n in os.listdir(save_dir) if n != LOCK)


@pytest.mark.parametrize("fmt", FORMATS)
def test_keep_last_rotates_saves_of_another_format_by_step(fmt, tmp_path):
    engine = _engine(keep_last=2)
    for _ in range(3):
        _step(engine)
        engine.save_checkpoint(str(tmp_path), format=fmt)
    want = ["global_step2", "global_step3", LATEST[fmt]]
    assert _listing(tmp_path) == want, f"{fmt}: rotation or leftovers"
    marker = json.loads((tmp_path / "global_step3" / "shardwise_save.json").read_text())
    assert (marker["format"], marker["step"]) == (fmt, 3), fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_save_of_another_format_below_the_directory_s_steps_is_refused(fmt, tmp_path):
    ahead = _engine()
    _step(ahead, 3)
    ahead.save_checkpoint(str(tmp_path), format=fmt)  # global_step3, of this format
    behind = _engine()
    _step(behind)
    with pytest.raises(CheckpointError, match=r"later steps.*global_step3 \(step 3\)"):
        behind.save_checkpoint(str(tmp_path), format="deepspeed")
    assert _listing(tmp_path) == ["global_step3", LATEST[fmt]], f"{fmt}: the refused save wrote"


def test_a_save_of_another_format_that_fails_midway_leaves_the_directory_as_it_was(
    tmp_path, monkeypatch
):
    engine = _engine()
    _step(engine)
    engine.save_checkpoint(str(tmp_path), format="deepspeed")
    _step(engine)
    written = []

    def disk_full(obj, path):  # the first file written, then the disk is full
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        torch.save(obj, path)

    monkeypatch.setattr(deepspeed_write, "write", disk_full)
    with pytest.raises(OSError, match="No space left"):
        engine.save_checkpoint(str(tmp_path), format="deepspeed")
    assert written, "the save never started writing"
    assert _listing(tmp_path) == ["global_step1", "latest"], "a half-written tag is visible"
    assert (tmp_path / "latest").read_text() == "global_step1"


def test_a_save_of_another_format_respects_another_job_s_lock(tmp_path):
    holder = {"host": "node-17", "pid": 4242, "pid_start": "9", "since": 0.0, "argv": "t.py"}
    (tmp_path / LOCK).write_text(json.dumps(holder))
    engine = _engine()
    _step(engine)
    with pytest.raises(CheckpointError, match=r"host 'node-17' pid 4242"):
        engine.save_checkpoint(str(tmp_path), format="dcp")
    assert _listing(tmp_path) == [], "nothing may be written under another job's lock"


@pytest.mark.parametrize("load_universal, want", [(False, "global_step3"), (True, "global_step2")])
def test_load_universal_loads_the_tag_latest_universal_names(load_universal, want, tmp_path):
    """As in DeepSpeed: with ``"checkpoint": {"load_universal": true}`` a load without a tag
    takes ``latest_universal``'s tag (a universal folder), otherwise ``latest``'s."""
    engine = _engine()
    _step(engine, 2)
    engine.save_checkpoint(str(tmp_path), format="deepspeed-universal")  # latest_universal
    _step(engine)
    engine.save_checkpoint(str(tmp_path))  # latest -> global_step3, shardwise's own
    other = _engine(load_universal=load_universal)
    path, _ = other.load_checkpoint(str(tmp_path))
    case = f"load_universal={load_universal}"
    assert path == str(tmp_path / want), f"{case}: loaded {path}"
    assert other.global_steps == int(want[-1]), case
