"""One rank's record as the watchdog writes it: ``<diagnose dir>/rank<N>.json``.

Where: ``<run dir>/diagnose/``, the run dir being ``comms.run_dir`` in the config, else
``$SHARDWISE_RUN_DIR`` (``shardwise run --run-dir``), else ``./shardwise-diagnose/`` (the working
directory). The file holds (JSON): rank, world size, host, pid, job id, the time and the reason
it was written; per group the calls entered and completed; the calls in flight and the recent
calls (recorder.py says what a call holds); the calls per call site; every thread's Python stack
and, for the thread that waits (else the main thread), its innermost frame and its innermost
frame outside shardwise and torch (``where``: the user's line).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from shardwise.diagnose.calls import CallLog

RUN_DIR_VAR = "SHARDWISE_RUN_DIR"
DEFAULT_DIR = "shardwise-diagnose"
VERSION = 1
_LIBRARIES = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # shardwise
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def diagnose_dir(run_dir: str | None = None) -> Path:
    """Where the records go (the module docstring says how it is chosen)."""
    run_dir = run_dir or os.environ.get(RUN_DIR_VAR)
    return Path(run_dir) / "diagnose" if run_dir else Path.cwd() / DEFAULT_DIR


def job_id() -> str:
    """What the ranks of one job (one restart attempt) share without talking to each other."""
    env = os.environ
    job = env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID")
    job = job or f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    return f"{job}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _frames(frame: FrameType | None) -> list[list[Any]]:
    return [[f.filename, f.lineno, f.name, f.line or ""] for f in traceback.extract_stack(frame)]


def user_frame(stack: list[list[Any]]) -> list[Any] | None:
    """The innermost frame outside shardwise and torch (the user's line), else the innermost."""
    for frame in reversed(stack):
        if not str(frame[0]).startswith(_LIBRARIES):
            return frame
    return stack[-1] if stack else None


def stacks(skip: int | None = None) -> dict[int, tuple[str, list[list[Any]]]]:
    """Every thread's stack but ``skip``'s: ident -> (name, frames, outermost first)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {
        ident: (names.get(ident, "thread"), _frames(frame))
        for ident, frame in sys._current_frames().items()
        if ident != skip
    }


def record(recorder: CallLog, rank: int, world_size: int, reason: str, skip: int | None) -> dict:
    """This rank's record (the module docstring lists what it holds)."""
    in_flight = sorted(recorder.in_flight(), key=lambda c: c.start)
    threads = stacks(skip)
    waiting = in_flight[0].thread if in_flight else threading.main_thread().ident
    if waiting not in threads:
        waiting = threading.main_thread().ident
    name, frames = threads.get(waiting, ("?", []))
    sites = list(recorder.sites.items())
    return {
        "version": VERSION,
        "rank": rank,
        "world_size": world_size,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": job_id(),
        "time": time.time(),
        "reason": reason,
        "groups": [g.as_dict() for g in recorder.groups()],
        "in_flight": [c.as_dict() for c in in_flight],
        "recent": [c.as_dict() for c in recorder.recent()],
        "sites": [
            {"group": g.name, "ranks": list(g.ranks), "op": op, "site": list(site), "calls": n}
            for (g, op, site), n in sites
        ],
        "stacks": {f"{n} ({ident})": f for ident, (n, f) in threads.items()},
        "thread": f"{name} ({waiting})",
        "where": user_frame(frames),
        "innermost": frames[-1] if frames else None,
    }


def write(directory: Path, data: dict) -> Path:
    """``directory/rank<N>.json``, written whole or not at all."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{data['rank']}.json"
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path
