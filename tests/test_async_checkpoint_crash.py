"""Asynchronous saves killed midway (issue 26): a SIGKILL during a background write leaves the
previous complete checkpoint as the one a restart resumes from, bit for bit; a SIGTERM during a
background write exits with the preemption code once both the save in flight and the
preemption save are complete.

Why a resume is bit-exact, not close: one thread per process, so every run computes the same
floating-point operations in the same order; the checkpoint holds every value the next step
reads (weights, AdamW moments and step counts, the scheduler, the random streams that drive
dropout, the loader's position), staged at the step boundary, so it equals the state of that
step whatever the training did while the thread wrote; and a write that never finished never
moved ``latest``. A resumed run therefore starts from the uninterrupted run's state and repeats
its operations exactly: any difference at all is a bug, so parameters compare with
``torch.equal``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from test_preemption import _cmd, _env
from waits import scaled

from shardwise.checkpoint import storage
from shardwise.launch.preempt import PREEMPTED_EXIT_CODE

SCRIPTS = Path(__file__).parent / "scripts"
KILLS = 20


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_sigkills_during_background_writes_resume_bit_exact_from_the_last_complete_save(
    tmp_path,
):
    """20 runs, each SIGKILLed at a random filesystem call of a background write (a tensor
    being written, an fsync, the rename into place, the move of ``latest``...): every restart
    resumes from the newest checkpoint complete at the kill, equal to the uninterrupted run's
    state at that step, and the last run ends equal to it (tests/scripts/async_kill.py)."""
    seed = int(os.environ.get("SHARDWISE_ASYNC_KILL_SEED", random.SystemRandom().randrange(10**6)))
    case = f"SHARDWISE_ASYNC_KILL_SEED={seed}"
    cmd = [sys.executable, str(SCRIPTS / "async_kill.py"), str(tmp_path), str(seed), str(KILLS)]
    run = subprocess.run(cmd, env=_env() | {"OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=scaled(240))  # fmt: skip
    errors = (tmp_path / "errors.txt").read_text() if (tmp_path / "errors.txt").exists() else ""
    assert run.returncode == 0 and not errors, f"{case}\n{errors}{run.stderr[-3000:]}"
    ends = [e["end"] for e in _lines(tmp_path / "exits.jsonl")]
    assert ends == ["exit 0"] * 2 + ["SIGKILL"] * KILLS + ["exit 0"], f"{case}: {ends}"
    kills, resumes = _lines(tmp_path / "kills.jsonl"), _lines(tmp_path / "resumes.jsonl")
    assert len(kills) == KILLS and len(resumes) == KILLS + 2, f"{case}: {kills} {resumes}"
    for i, kill in enumerate(kills):
        after = resumes[i + 1]  # the restart that followed kill i
        where = f"{case}, kill {i} at event {kill['event']} ({kill['what']}) of step {kill['step']}"
        assert after["step"] == kill["expect"], f"{where}: resumed from step {after['step']}"
        assert after["differ"] == [], f"{where}: resumed state differs in {after['differ']}"
    assert resumes[-1] == {"run": KILLS, "final": 64, "differ": []}, f"{case}: {resumes[-1]}"
    moments = {k["what"] for k in kills}
    assert "tensor" in moments, f"{case}: no kill in the middle of a file: {moments}"


def test_sigterm_during_a_background_write_exits_75_after_both_saves(tmp_path):
    """Two workers save every 2 steps asynchronously through a slow writer (it holds its file
    until the signal is sent); rank 1 gets SIGTERM in step 3 while the step-2 save is still
    writing. The step's end waits for it, saves step 3, and the job exits 75 with both
    checkpoints complete, ``latest`` on the second (a step-3 save that did not wait could be
    overtaken by the step-2 publish, which would move ``latest`` back)."""
    hold = f"{scaled(60):.0f}"  # seconds at most: the signal comes within a step of the save
    args = [str(tmp_path), "dp2:term:1:3", "--interval", "2", "--async", "--slow-write", hold]
    run = subprocess.run(
        _cmd(*args), env=_env(), capture_output=True, text=True, timeout=scaled(180)
    )
    marker = tmp_path / "dp2" / "signalled"
    signalled = json.loads(marker.read_text()) if marker.exists() else None
    assert signalled == {"in_flight": True, "step": 3}, f"{signalled}\n{run.stderr[-3000:]}"
    assert run.returncode == PREEMPTED_EXIT_CODE, f"exit {run.returncode}\n{run.stderr[-3000:]}"
    assert "SIGTERM (on 1 of 2 ranks): stopped after step 3" in run.stderr, run.stderr[-3000:]
    ckpts = tmp_path / "dp2" / "ckpts"
    assert sorted(os.listdir(ckpts)) == ["global_step2", "global_step3", "latest"], "dp2"
    assert storage.latest_tag(str(ckpts)) == "global_step3", "the preemption save is the newest"
    for tag in ("global_step2", "global_step3"):
        with storage.CheckpointReader(str(ckpts / tag)) as reader:
            assert reader.verify_all() > 0, f"{tag}: empty"  # every CRC-32 checked
