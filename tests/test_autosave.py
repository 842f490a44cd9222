"""``checkpoint.save_dir`` / ``save_interval_steps`` / ``auto_resume`` and the SIGTERM flag, in
one process (training/checkpoints/autosave.py, launch/preempt.py). The multi-process behaviour (kills,
restarts, signals to the launcher, bit-exact resumes) is in test_preemption.py; the keys'
validation in test_config.py."""

import gc
import os
import signal
import subprocess
import sys
import time

import pytest
from checkpointing import config, engine_for
from waits import scaled

from shardwise.checkpoint import storage
from shardwise.launch.preempt import PREEMPTED_EXIT_CODE, Preempted, SignalFlag
from shardwise.training.checkpoints.autosave import newest_tag


def _engine(path, **block):
    return engine_for(config(checkpoint={"save_dir": str(path), **block}), 0.0, seed=0)


def _saved(path) -> list[str]:
    return sorted((n for n in os.listdir(path) if n.startswith("global_step")), key=len)


@pytest.mark.parametrize(
    "block, calls, saved",
    [
        ({}, 4, []),  # save_dir alone: saves only when a SIGTERM stops the run
        ({"save_interval_steps": 2}, 5, ["global_step2", "global_step4"]),
        ({"save_interval_steps": 2, "keep_last": 1}, 5, ["global_step4"]),
        # forward/backward/step with GAS 2: 3 micro-steps are one optimizer step
        ({"save_interval_steps": 1, "gradient_accumulation_steps": 2}, 3, ["global_step1"]),
    ],
)
def test_interval_saves(block, calls, saved, tmp_path):
    gas = block.pop("gradient_accumulation_steps", 1)
    cfg = config(gradient_accumulation_steps=gas, checkpoint={"save_dir": str(tmp_path), **block})
    engine = engine_for(cfg, 0.0, seed=0)
    batches = engine.training_dataloader.repeating() if gas > 1 else None
    try:
        for _ in range(calls):
            if gas == 1:
                engine.train_batch()
            else:
                engine.backward(engine(next(batches)[0]).pow(2).mean())
                engine.step()
    finally:
        engine.destroy()
    case = f"{block}, GAS {gas}, {calls} calls"
    assert (_saved(tmp_path) if tmp_path.exists() else []) == saved, case


def test_auto_resume_loads_the_newest_checkpoint(tmp_path):
    first = _engine(tmp_path, save_interval_steps=2)
    for _ in range(5):
        first.train_batch()
    first.destroy()
    fresh = _engine(tmp_path, auto_resume=True)
    fresh.destroy()
    assert fresh.global_steps == 4, "resumed from global_step4"
    assert fresh.autosave.resumed_from == str(tmp_path / "global_step4")
    (tmp_path / "latest").unlink()  # lost: the checkpoint of the highest step is taken
    assert newest_tag(str(tmp_path)) == "global_step4"


def test_auto_resume_of_an_empty_directory_starts_at_step_0(tmp_path, capfd):
    engine = _engine(tmp_path / "new", auto_resume=True)
    engine.destroy()
    assert engine.global_steps == 0 and engine.autosave.resumed_from is None
    assert "no checkpoint in" in capfd.readouterr().err, "the start says it found nothing"


@pytest.mark.parametrize("interval", [None, 2, 3])
def test_a_sigterm_saves_the_step_and_raises_preempted(interval, tmp_path):
    engine = _engine(tmp_path, save_interval_steps=interval)
    calls = []
    save = engine.save_checkpoint
    engine.save_checkpoint = lambda *a, **k: calls.append(engine.global_steps) or save(*a, **k)
    try:
        engine.train_batch()
        engine.autosave.sigterm.received = True  # what the handler does
        with pytest.raises(Preempted) as stop:
            engine.train_batch()
    finally:
        engine.destroy()
    case = f"save_interval_steps={interval}"
    assert stop.value.code == PREEMPTED_EXIT_CODE == 75, case
    assert (stop.value.step, stop.value.checkpoint) == (2, str(tmp_path / "global_step2")), case
    assert calls == [2], f"{case}: step 2 saved once, whether or not the interval saved it"
    assert (tmp_path / "latest").read_text().strip() == "global_step2", case


def test_an_idle_sigterm_exit_waits_for_the_save_in_flight_and_names_it(tmp_path, monkeypatch):
    """A SIGTERM outside a step while an asynchronous save writes (its handler calls
    ``_idle_exit``): the save in flight is written first, and it is the checkpoint the exit
    names, not the one before it."""
    engine = _engine(tmp_path, save_interval_steps=1, **{"async": True})
    write = storage._write_rank_file

    def slow(*args, **kwargs):  # a slow disk: the write is still going when the signal comes
        time.sleep(1.0)
        return write(*args, **kwargs)

    monkeypatch.setattr(storage, "_write_rank_file", slow)
    try:
        engine.train_batch()
        engine.wait_for_checkpoint()  # global_step1 is complete
        engine.train_batch()  # global_step2 is being written
        stop = engine.autosave._idle_exit()
    finally:
        engine.destroy()
    assert stop.code == PREEMPTED_EXIT_CODE and stop.step == 2
    assert stop.checkpoint == str(tmp_path / "global_step2"), stop.checkpoint
    assert newest_tag(str(tmp_path)) == "global_step2"


def test_the_handler_sets_a_flag_chains_and_lets_go():
    """SIGUSR1 stands in for SIGTERM (whose default would end pytest)."""
    heard = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: heard.append("user"))
    try:
        flag = SignalFlag(signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.received and heard == ["user"], "the flag is set; the user's handler still runs"
        flag.close()
        flag.received = False
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not flag.received and heard == ["user", "user"], "closed: the user's handler only"
        assert signal.getsignal(signal.SIGUSR1) is not flag._handler, "closed: ours is unset"
    finally:
        signal.signal(signal.SIGUSR1, previous)


DROPPED = """
import gc, os, signal
from shardwise.launch.preempt import SignalFlag
flag = SignalFlag()
del flag
gc.collect()
os.kill(os.getpid(), signal.SIGTERM)
print("survived")
"""


def test_a_flag_nobody_holds_lets_sigterm_end_the_process():
    gc.collect()
    out = subprocess.run(
        [sys.executable, "-c", DROPPED], capture_output=True, text=True, timeout=scaled(60)
    )
    assert out.returncode == -signal.SIGTERM, f"exit {out.returncode}: {out.stdout}{out.stderr}"
    assert "survived" not in out.stdout
