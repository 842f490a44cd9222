"""Killed and preempted jobs resume exactly, with no checkpoint code in the script (issue 13).

Real jobs of two workers under ``shardwise run`` (tests/scripts/autoresume.py: a training loop
and a config with ``"checkpoint": {"save_dir", "save_interval_steps": 3, "auto_resume": true}``).
Each compares its final weights, bit for bit, with an uninterrupted run of the same layout
(fp32, one thread per rank). A resumed engine starts from other initial weights and random
streams (another seed), so a resume that restored anything short of everything fails; so
does one that silently started over, since the log must name the checkpoint it resumed.

* SIGKILL of a random rank at a random step under ``--max-restarts``: data parallel, ZeRO-3
  and a two-stage pipeline (one launch: the layouts run one after the other, each killed once;
  a restarted group skips the layouts already done). The rank and step are drawn anew on each
  run and named in every message; ``SHARDWISE_PREEMPT_SEED`` replays a draw.
* SIGTERM to the launcher: the workers finish their step, save it, and the launcher exits 75
  with one line, no traceback; the same command resumes from that step.
* SIGKILL to the launcher: its workers get SIGTERM (their parent-death signal) and save.
* SIGTERM to one worker only: every rank stops after the same step (they agree by an
  all-reduce), and the launcher still exits 75.
* SIGTERM to workers that cannot save (no engine): the launcher exits 143, in one line.
* SIGTERM after the training loop (engine alive, no step to come): the workers exit 75 within
  the idle grace, not after torchrun's 30 s and its SIGKILL.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from waits import scaled

from shardwise.launch.preempt import IDLE_GRACE_S, PREEMPTED_EXIT_CODE

SCRIPT = str(Path(__file__).parent / "scripts" / "autoresume.py")
LINGER = str(Path(__file__).parent / "scripts" / "linger.py")  # joins the world, then sleeps
LAYOUTS = ("dp2", "zero3-dp2", "pp2")
STEPS, INTERVAL = 10, 3  # the script's defaults
DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _cmd(*args: str, restarts: int = 0, script: str = SCRIPT) -> list[str]:
    run = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", "2"]
    return [*run, "--max-restarts", str(restarts), script, *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DROP}
    env.pop("OMP_NUM_THREADS", None)  # shardwise run sets 1: runs repeat bit for bit
    return env


def _same_weights(folder: Path, case: str) -> None:
    final = load_file(folder / "final.safetensors")
    reference = load_file(folder / "reference.safetensors")
    assert final.keys() == reference.keys(), case
    for name, want in reference.items():
        diff = (final[name] - want).abs().max().item()
        assert torch.equal(final[name], want), f"{case}: {name} differs by up to {diff:g}"


def _resumed_from(log: str, folder: Path) -> list[int]:
    """The steps the log says a job resumed from, in ``folder``'s save directory."""
    found = re.findall(rf"resumed from {re.escape(str(folder / 'ckpts'))}/global_step(\d+)", log)
    return [int(s) for s in found]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """One launch; each layout SIGKILLs a random rank at a random step after the first save."""
    seed = int(os.environ.get("SHARDWISE_PREEMPT_SEED", random.SystemRandom().randrange(10**6)))
    rng = random.Random(seed)
    draws = {name: (rng.randrange(2), rng.randint(INTERVAL + 1, STEPS)) for name in LAYOUTS}
    out = tmp_path_factory.mktemp("killed")
    phases = [f"{name}:kill:{rank}:{step}" for name, (rank, step) in draws.items()]
    cmd = _cmd(str(out), *phases, restarts=len(LAYOUTS))
    limit = scaled(150)
    try:
        run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:  # reported by each row, with the seed that replays it
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        run = subprocess.CompletedProcess(cmd, -1, "", err + f"\n[timed out after {limit:.0f} s]")
    return out, run, draws, seed


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_killed_rank_resumes_bit_exact(killed, layout):
    out, run, draws, seed = killed
    rank, step = draws[layout]
    case = f"{layout}, rank {rank} SIGKILLed in step {step} (SHARDWISE_PREEMPT_SEED={seed})"
    assert run.returncode == 0, f"{case}: exit {run.returncode}\n{run.stderr[-3000:]}"
    assert (out / layout / "signalled").exists(), f"{case}: the kill never happened"
    saved = (step - 1) // INTERVAL * INTERVAL  # the last interval save before the kill
    assert _resumed_from(run.stderr, out / layout) == [saved], f"{case}: {run.stderr[-3000:]}"
    _same_weights(out / layout, case)


def _wait_for_step(progress: Path, step: int, launcher: subprocess.Popen, seconds: float) -> int:
    limit = scaled(seconds)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and launcher.poll() is None:
        text = progress.read_text() if progress.exists() else ""
        if text and int(text) >= step:
            return int(text)
        time.sleep(0.05)
    load = os.getloadavg()[0]
    raise AssertionError(
        f"the job never reached step {step} in {limit:.0f} s (exit {launcher.poll()}, load "
        f"average {load:.1f} on {os.cpu_count()} cores)"
    )


def test_sigterm_to_the_launcher_saves_the_step_and_exits_75(tmp_path):
    steps, folder = "40", tmp_path / "dp2"
    args = [str(tmp_path), "dp2", "--steps", steps, "--interval", "5"]
    launcher = subprocess.Popen(
        _cmd(*args, "--sleep", "0.2"), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        at_signal = _wait_for_step(folder / "progress", 3, launcher, 90)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=scaled(60))
    finally:
        launcher.kill()
    err = err.decode()
    assert launcher.returncode == PREEMPTED_EXIT_CODE, f"exit {launcher.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err, f"a traceback instead of one line:\n{err[-3000:]}"
    line = [x for x in err.splitlines() if x.startswith("shardwise run: preempted (SIGTERM)")]
    saved = re.search(r"global_step(\d+)", line[0] if line else "")
    assert saved, f"the launcher's line names the checkpoint:\n{err[-3000:]}"
    step = int(saved.group(1))
    assert at_signal <= step < int(steps), f"saved step {step}, signalled at step {at_signal}"
    latest = (folder / "ckpts" / "latest").read_text().strip()
    assert latest == f"global_step{step}", f"latest is {latest}, the launcher said step {step}"

    again = subprocess.run(
        _cmd(*args), env=_env(), capture_output=True, text=True, timeout=scaled(120)
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert _resumed_from(again.stderr, folder) == [step], again.stderr[-3000:]
    _same_weights(folder, f"dp2, SIGTERM to the launcher at step {at_signal}")


def test_the_workers_of_a_sigkilled_launcher_save_their_step(tmp_path):
    """Their parent-death signal is SIGTERM (launch/guard.py): with a save_dir they save the
    step it interrupts (no interval saves here: any checkpoint is that one)."""
    folder = tmp_path / "dp2"
    args = [str(tmp_path), "dp2", "--steps", "40", "--interval", "1000", "--sleep", "0.2"]
    launcher = subprocess.Popen(_cmd(*args), env=_env(), stderr=subprocess.DEVNULL)
    try:
        at_kill = _wait_for_step(folder / "progress", 3, launcher, 90)
    finally:
        launcher.kill()
        launcher.wait(scaled(10))
    latest = folder / "ckpts" / "latest"
    deadline = time.monotonic() + scaled(30)
    while time.monotonic() < deadline and not latest.exists():
        time.sleep(0.1)
    saved = latest.read_text() if latest.exists() else "nothing"
    assert saved in {f"global_step{s}" for s in range(at_kill, 40)}, f"killed at step {at_kill}"


def test_sigterm_to_one_worker_stops_every_rank_after_the_same_step(tmp_path):
    run = subprocess.run(
        _cmd(str(tmp_path), "pp2:term:1:4"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert run.returncode == PREEMPTED_EXIT_CODE, f"exit {run.returncode}\n{run.stderr[-3000:]}"
    assert "SIGTERM (on 1 of 2 ranks): stopped after step 4" in run.stderr, run.stderr[-3000:]
    assert "shardwise run: preempted (SIGTERM to the workers)" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    ckpts = tmp_path / "pp2" / "ckpts"
    assert (ckpts / "latest").read_text().strip() == "global_step4", "pp2: the step is saved"
    assert sorted(os.listdir(ckpts)) == ["global_step3", "global_step4", "latest"], "pp2"


def test_sigterm_to_workers_that_cannot_save_exits_128_plus_15(tmp_path):
    """No engine with a save_dir: the workers die of the forwarded SIGTERM, and the launcher
    says so in one line and exits as a shell reports a SIGTERM, 143 (not 1, not 75)."""
    launcher = subprocess.Popen(
        _cmd(str(tmp_path), script=LINGER),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + scaled(90)
        while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=scaled(60))
    finally:
        launcher.kill()
    err = err.decode()
    assert launcher.returncode == 128 + signal.SIGTERM, f"exit {launcher.returncode}\n{err[-3000:]}"
    assert "shardwise run: stopped by SIGTERM; the workers exited without saving" in err, err
    assert "Traceback" not in err, f"a traceback instead of one line:\n{err[-3000:]}"


def test_sigterm_after_the_training_loop_exits_75_within_the_grace(tmp_path):
    folder = tmp_path / "dp2"
    args = [str(tmp_path), "dp2", "--steps", "4", "--interval", "2", "--linger", "600"]
    launcher = subprocess.Popen(_cmd(*args), env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + scaled(120)
        while len(list(folder.glob("looped-rank*"))) < 2 and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _, err = launcher.communicate(timeout=scaled(IDLE_GRACE_S + 60))
        took = time.monotonic() - signalled
    finally:
        launcher.kill()
    assert launcher.returncode == PREEMPTED_EXIT_CODE, f"exit {launcher.returncode}\n{err[-3000:]}"
    assert "SIGTERM outside a training step (after step 4)" in err, err[-3000:]
    assert "global_step4" in err, f"the newest checkpoint is the step-4 save: {err[-3000:]}"
    # torchrun waits 30 s for the workers before its SIGKILL; the grace is 10 s.
    assert took < IDLE_GRACE_S + scaled(15), f"exited {took:.0f} s after the SIGTERM"
