"""Workers started by ``shardwise run`` die with their launcher and report their exceptions to
its failure summary (issue 13 items 8 and 9; launch/guard.py).

Real launches of two workers (tests/scripts/linger.py). A SIGKILLed launcher cannot clean up
after itself: its workers must go by themselves (before: they kept training for minutes and
wrote more checkpoints). A worker's uncaught exception must be what the summary's "Root Cause"
shows (before: ``error_file: <N/A>``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from waits import scaled

from shardwise.launch.guard import die_with_launcher, record_uncaught_errors, restart_notice

SCRIPT = str(Path(__file__).parent / "scripts" / "linger.py")
DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in DROP}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) has finished too.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + scaled(seconds)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_workers_die_with_a_sigkilled_launcher(tmp_path):
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", "2", SCRIPT, str(tmp_path)]
    launcher = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        pids = [tmp_path / f"rank{r}.pid" for r in range(2)]
        assert _wait_for(lambda: all(p.exists() for p in pids), 120), "workers never started"
        workers = [int(p.read_text()) for p in pids]
        assert all(_alive(w) for w in workers), "workers should be running before the kill"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        gone = _wait_for(lambda: not any(_alive(w) for w in workers), 15)
        assert gone, f"workers {[w for w in workers if _alive(w)]} outlived their launcher"
    finally:
        launcher.kill()
        for p in tmp_path.glob("rank*.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_workers_exception_is_the_root_cause_in_the_summary(tmp_path):
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", "2", SCRIPT, str(tmp_path)]
    out = subprocess.run(
        [*cmd, "--raise"], env=_env(), capture_output=True, text=True, timeout=scaled(180)
    )
    assert out.returncode == 1, out.stderr[-3000:]
    summary = out.stderr[out.stderr.rfind("Root Cause") :]
    assert "error_file: <N/A>" not in summary, summary
    assert "rank 1 gave up on purpose" in summary, summary
    assert "linger.py" in summary, f"the traceback names the script's line: {summary}"
    # Issue 15: the first failing rank, its host and its exception come first, and the
    # resolved world before anything starts.
    first = out.stderr.splitlines()[0]
    assert first.startswith("shardwise run: 1 node x 2 processes = world 2"), first
    headline = f"rank 1 (local rank 1, host {socket.gethostname()}) failed first: ValueError:"
    at = out.stderr.find(f"shardwise run: {headline}")
    assert 0 <= at < out.stderr.find("Root Cause"), out.stderr[-3000:]
    assert "gave up on purpose" in out.stderr[at:].splitlines()[0], out.stderr[at:][:300]


def test_no_launcher_no_guard(monkeypatch):
    """Outside ``shardwise run`` (or under a wrapper that is not the launcher) nothing is armed,
    and without torchrun's error file the excepthook is left alone."""
    assert not die_with_launcher({}), "no launcher pid: nothing to follow"
    assert not die_with_launcher({"SHARDWISE_LAUNCHER_PID": str(os.getpid())}), (
        "a launcher pid that is not our parent must not be followed"
    )
    hook = sys.excepthook
    assert not record_uncaught_errors({}) and sys.excepthook is hook


def test_rank_0_of_a_restarted_group_says_which_attempt():
    env = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "2"}
    assert restart_notice(0, env) == "[shardwise] worker group restarted: attempt 1 of 2"
    assert restart_notice(1, env) is None, "one line per job, from rank 0"
    assert restart_notice(0, {"TORCHELASTIC_RESTART_COUNT": "0"}) is None, "first attempt"
