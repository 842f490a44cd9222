"""Asynchronous checkpoint saves (issue 26; shardwise/checkpoint/async_save.py).

A save written in the background holds exactly what a blocking save of the same step holds,
although training goes on and changes every tensor while it writes (compared with
``torch.equal``: the same bytes, copied at the step boundary); its staging buffers are reused
from save to save; a write that fails on one rank surfaces on every rank at the next step,
naming the rank, the file and the error, and never moves ``latest``; the config's ``"async": true``
makes the periodic saves asynchronous.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from models import make_data, make_model

import shardwise
from shardwise.checkpoint import storage
from shardwise.checkpoint.export import assemble
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.reader import CheckpointReader

SGD = {"type": "Adam", "params": {"lr": 0.01}}


def _engine(config: dict | None = None):
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD, **(config or {})}
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    return engine


def _step(engine, seed: int) -> None:
    torch.manual_seed(seed + 100 * engine.global_rank)
    x, y = make_data(2)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()


def _contents(path: str) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as r:
        return {n: assemble(r, n) for n in r.names()}


def _same_as_blocking(root: str, zero: int) -> list[str]:
    """Save blocking and asynchronously at one step, train on during the write: the names of
    the tensors that differ (none expected)."""
    engine = _engine({"zero_optimization": {"stage": zero}})
    for s in range(2):
        _step(engine, s)
    engine.save_checkpoint(root + "/blocking", tag="t")
    handle = engine.save_checkpoint(root + "/async", tag="t", async_save=True)
    for s in range(2, 4):
        _step(engine, s)  # changes weights and moments while the thread writes
    assert handle.wait() == f"{root}/async/t"
    a, b = _contents(root + "/async/t"), _contents(root + "/blocking/t")
    differ = sorted(n for n in a if not torch.equal(a[n], b[n]))
    engine.destroy()
    return differ + sorted(set(a) ^ set(b))


@pytest.mark.parametrize("procs, zero", [(1, 0), (2, 0), (2, 2)], ids=["1proc", "dp2", "zero2x2"])
def test_an_async_save_holds_what_a_blocking_save_of_the_step_holds(tmp_path, procs, zero):
    root = str(tmp_path)
    for rank, differ in enumerate(run_distributed(_same_as_blocking, procs, root, zero)):
        assert differ == [], f"{procs} procs zero{zero}, rank {rank}: {differ} differ"


def test_staging_buffers_are_reused_from_save_to_save(tmp_path):
    engine = _engine()
    _step(engine, 0)
    engine.save_checkpoint(str(tmp_path), async_save=True)
    writer = engine.autosave.writer
    first = {k: v.data_ptr() for k, v in writer.staging.items()}
    _step(engine, 1)
    engine.save_checkpoint(str(tmp_path), async_save=True)
    engine.wait_for_checkpoint()
    assert {k: v.data_ptr() for k, v in writer.staging.items()} == first, "new buffers"
    assert writer.staging_bytes() > 0
    memory = engine.memory_breakdown()
    assert memory["checkpoint_staging"] == writer.staging_bytes(), memory
    # the weights and Adam's two moments, once each, and Adam's step counts (a scalar of at
    # most 8 bytes per tensor): the staging is the model state again, not more
    extra = writer.staging_bytes() - memory["params"] - memory["optimizer"]
    assert 0 <= extra <= 8 * len(list(engine.module.parameters())), memory
    assert storage.latest_tag(str(tmp_path)) == "global_step2"
    engine.destroy()


def _failing_write(root: str) -> str:
    engine = _engine()
    _step(engine, 0)
    engine.save_checkpoint(root, async_save=True)
    engine.wait_for_checkpoint()  # global_step1 is complete
    _step(engine, 1)
    original = storage._write_rank_file

    def full_disk(tmp, rank, pieces, rank_state):  # noqa: ANN001
        if rank == 1:
            raise OSError(28, "No space left on device")
        return original(tmp, rank, pieces, rank_state)

    storage._write_rank_file = full_disk
    try:
        handle = engine.save_checkpoint(root, async_save=True)
        while not handle.done():  # training would go on; here the next step comes after it
            time.sleep(0.01)
        try:
            _step(engine, 2)
            message = "no error"
        except CheckpointError as e:
            message = str(e)
    finally:
        storage._write_rank_file = original
    engine.destroy()
    return message


def test_a_failed_background_write_surfaces_on_every_rank_at_the_next_step(tmp_path):
    root = str(tmp_path)
    for rank, message in enumerate(run_distributed(_failing_write, 2, root)):
        assert "asynchronous save failed" in message, f"rank {rank}: {message}"
        assert "rank 1, rank_00001.safetensors: OSError" in message, f"rank {rank}: {message}"
        assert "No space left" in message and "'global_step2'" in message, f"rank {rank}"
    assert storage.latest_tag(root) == "global_step1", "latest moved to a failed save"
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
        "global_step1",
        "latest",
    ]


def test_the_config_makes_the_periodic_saves_asynchronous(tmp_path):
    block = {"save_dir": str(tmp_path), "save_interval_steps": 1, "async": True}
    engine = _engine({"checkpoint": block})
    for s in range(3):
        _step(engine, s)
    assert engine.autosave.writer is not None, "the periodic saves did not go to the writer"
    engine.wait_for_checkpoint()
    assert storage.latest_tag(str(tmp_path)) == "global_step3"
    want = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    other = _engine()
    other.load_checkpoint(str(tmp_path))
    for n, p in other.module.named_parameters():
        assert torch.equal(p, want[n]), f"{n} after loading the asynchronous save"
    other.destroy()


def test_a_blocking_save_waits_for_the_one_in_flight(tmp_path):
    engine = _engine()
    _step(engine, 0)
    handle = engine.save_checkpoint(str(tmp_path / "a"), async_save=True)
    engine.save_checkpoint(str(tmp_path / "b"))
    assert handle.done(), "a blocking save started while an asynchronous one was writing"
    assert Path(handle.path, "manifest.json").is_file()
    engine.destroy()
