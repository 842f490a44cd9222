"""A save directory belongs to one run and one job: rotation by step, no save over a later run's
checkpoints, one lock per directory.

The issue's accident, replayed with the engine on 2 ranks: a run saves global_step1..5 with
``keep_last: 3``; ``latest`` is lost; the restarted run's ``load_checkpoint`` finds nothing
and training restarts from step 0. Before, its saves overwrote same-named tags and rotation
(by creation time) deleted the real global_step3..5 after 3 saves. Now the first save is refused
before anything is written, naming the newer checkpoints and the ways out; after
``load_checkpoint`` of that directory, or with ``"checkpoint": {"overwrite_newer": true}``, it
proceeds and rotation still never deletes a checkpoint of a later step.
"""

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpointing import config, engine_for, load, save
from harness import run_distributed

from shardwise.checkpoint.lock import LOCK
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.storage import CheckpointReader, save_pieces


def visible(save_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(save_dir) if not n.startswith("."))


def _save_step(save_dir: Path, step: int, **kw) -> None:
    w = Piece("model/w", (3,), ((0, 3),), None, torch.full((3,), float(step)))
    save_pieces(str(save_dir), f"global_step{step}", [w], {}, {}, step=step, **kw)


# ----------------------------------------------------------------------------- storage


def test_rotation_keeps_the_highest_steps_not_the_newest_files(tmp_path):
    for step in (30, 10, 20):  # written in this order: by creation time 20 is the newest
        _save_step(tmp_path, step, allow_newer=True)
    _save_step(tmp_path, 40, keep_last=2)
    assert visible(tmp_path) == ["global_step30", "global_step40", "latest"]


def test_rotation_never_deletes_a_later_step(tmp_path):
    for step in (30, 40, 50):
        _save_step(tmp_path, step)
    for step in (1, 2, 3, 4):  # a restarted run, allowed to write here
        _save_step(tmp_path, step, keep_last=2, allow_newer=True)
    want = ["global_step3", "global_step30", "global_step4", "global_step40", "global_step50"]
    assert visible(tmp_path) == [*want, "latest"], "rotation deleted a later step"


def test_a_save_below_the_directory_s_steps_is_refused_before_writing(tmp_path):
    _save_step(tmp_path, 50)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(CheckpointError, match=r"global_step50 \(step 50\).*overwrite_newer"):
        _save_step(tmp_path, 10, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == before, "the refused save wrote something"
    assert (tmp_path / "latest").read_text() == "global_step50"


# ----------------------------------------------------------------------------- the engine


def _restart_without_latest(path: str) -> dict:
    """Run 1 saves steps 1..5 (keep_last 3); 'latest' vanishes; runs 2-4 start over."""
    cfg = config(checkpoint={"keep_last": 3})
    engine = engine_for(cfg, 0.0, seed=0)
    for _ in range(5):
        engine.train_batch()
        save(engine, path)
    rank = engine.global_rank
    out = {"run1": visible(Path(path))}
    torch.distributed.barrier()
    if rank == 0:
        os.remove(os.path.join(path, "latest"))
    torch.distributed.barrier()
    # Run 2: nothing loaded, training restarts at step 0, its first save is refused.
    fresh = engine_for(cfg, 0.0, seed=1)
    records = _logged(lambda: out.update(loaded=load(fresh, path)))
    out["warning"] = next((m for m in records if "no 'latest'" in m), None)
    fresh.train_batch()
    try:
        save(fresh, path)
    except CheckpointError as e:
        out["refused"] = str(e)
    out["after_refusal"] = visible(Path(path))
    # Run 3: told to write here anyway; its rotation leaves the later steps alone.
    told = engine_for(config(checkpoint={"keep_last": 3, "overwrite_newer": True}), 0.0, seed=1)
    for _ in range(2):
        told.train_batch()
        save(told, path)
    out["run3"] = visible(Path(path))
    # Run 4: resumes from global_step4 by name, then saves over step 5 (not a later step).
    resumed = engine_for(cfg, 0.0, seed=1)
    load(resumed, path, tag="global_step4")
    resumed.train_batch()
    save(resumed, path)
    out["run4"] = visible(Path(path))
    return out


def _logged(fn) -> list[str]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("shardwise").addHandler(handler)
    try:
        fn()
    finally:
        logging.getLogger("shardwise").removeHandler(handler)
    return [r.getMessage() for r in records]


def test_a_lost_latest_does_not_cost_the_real_checkpoints(tmp_path):
    steps = lambda *s: [f"global_step{n}" for n in s]  # noqa: E731
    for rank, r in enumerate(run_distributed(_restart_without_latest, 2, str(tmp_path))):
        tag = f"rank {rank}"
        assert r["run1"] == [*steps(3, 4, 5), "latest"], tag
        assert r["loaded"] == (None, None), tag
        assert r["warning"] and "global_step5" in r["warning"], f"{tag}: {r['warning']}"
        refused = r.get("refused") or ""
        for needle in ("later steps than this run (step 1", "global_step5 (step 5)",
                       "load_checkpoint", "overwrite_newer"):  # fmt: skip
            assert needle in refused, f"{tag}: no {needle!r} in the refusal: {refused!r}"
        assert r["after_refusal"] == steps(3, 4, 5), f"{tag}: the refused save wrote"
        assert r["run3"] == [*steps(1, 2, 3, 4, 5), "latest"], f"{tag}: later steps deleted"
        assert r["run4"] == [*steps(3, 4, 5), "latest"], f"{tag}: rotation after the resume"
    with CheckpointReader(str(tmp_path / "global_step5")) as ckpt:
        assert ckpt.meta["counters"]["global_steps"] == 5 and ckpt.manifest["step"] == 5


# ----------------------------------------------------------------------------- the lock


def _hold(path: str) -> int:
    """A 2-rank job saves into ``path`` and keeps running (its rank 0 holds the lock)."""
    save(engine_for(config(), 0.0, seed=0), path)
    return os.getpid()


def _second_job(path: str) -> str:
    engine = engine_for(config(), 0.0, seed=0)
    engine.train_batch()  # step 1: not behind the first job's step 0
    with pytest.raises(CheckpointError) as e:
        save(engine, path)
    return str(e.value)


def test_a_second_job_cannot_save_into_a_locked_directory(tmp_path):
    holder = run_distributed(_hold, 2, str(tmp_path))[0]  # the world's rank 0 process
    message = _second_job(str(tmp_path))  # this process: another job
    for needle in (f"host {socket.gethostname()!r} pid {holder}", "locked by another job",
                   f"delete {tmp_path / LOCK}"):  # fmt: skip
        assert needle in message, f"no {needle!r} in: {message}"
    assert visible(tmp_path) == ["global_step0", "latest"], "the second job wrote"


def _lock_file(save_dir: Path, **holder) -> None:
    save_dir.mkdir(exist_ok=True)
    (save_dir / LOCK).write_text(json.dumps({"since": 0.0, "argv": "train.py", **holder}))


def _gone_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(autouse=True)
def no_job_id(monkeypatch):
    """Outside any Slurm job or torchelastic run (a lock of the same job is taken over)."""
    for var in ("SLURM_JOB_ID", "SLURM_JOBID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("holder", ["dead pid", "recycled pid", "same Slurm job elsewhere"])
def test_a_stale_lock_is_taken_over(holder, tmp_path, caplog, monkeypatch):
    here = socket.gethostname()
    if holder == "dead pid":
        _lock_file(tmp_path, host=here, pid=_gone_pid(), pid_start="1")
    elif holder == "recycled pid":  # a live process, but not the one that took the lock
        _lock_file(tmp_path, host=here, pid=os.getppid(), pid_start="-1")
    else:  # a requeued Slurm job keeps its id, not its nodes
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        _lock_file(tmp_path, host="node-17", pid=4242, pid_start="9", job="SLURM_JOB_ID=77")
    with caplog.at_level("WARNING", logger="shardwise"):
        _save_step(tmp_path, 1)
    assert "taking over the lock" in caplog.text, holder
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid(), holder


def test_a_lock_from_another_host_says_how_to_clear_it(tmp_path, caplog):
    _lock_file(tmp_path, host="node-17", pid=4242, pid_start="9", job="SLURM_JOB_ID=76")
    with pytest.raises(CheckpointError, match=r"host 'node-17' pid 4242.*delete .*shardwise-lock"):
        _save_step(tmp_path, 1)
    assert visible(tmp_path) == [], "nothing may be written under another job's lock"
    # A job loading from a locked directory hears it at its start, not at its first save.
    (tmp_path / LOCK).rename(tmp_path / "lock")  # the other job's lock aside, for one save
    engine = engine_for(config(), 0.0, seed=0)
    save(engine, str(tmp_path))
    (tmp_path / "lock").replace(tmp_path / LOCK)
    with caplog.at_level("WARNING", logger="shardwise"):
        assert load(engine, str(tmp_path))[0].endswith("global_step0")
    assert "locked by another job (host 'node-17'" in caplog.text
