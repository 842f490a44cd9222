"""One job per save directory: ``<save_dir>/.shardwise-lock``.

The first save of a process into a directory takes the lock (rank 0 of the saving group, the
one that publishes); the process keeps it until it exits. The file holds JSON naming the
holder: ``{"host", "pid", "pid_start", "job", "since", "argv"}`` (``pid_start``: the process's
start time from ``/proc``, so that a recycled pid is not mistaken for the holder; ``job``: the
Slurm job id or torchelastic run id, when there is one).

Another process that wants to save there:
  - the lock names this process: it holds it already (several engines of one process, one
    after the other, share it);
  - the holder is on this host and its process is gone (killed, crashed): the lock is stale and
    is taken over, with a warning;
  - the holder belongs to this same job (a Slurm job requeued, maybe onto other nodes, keeps
    its id; so does a torchelastic run restarted): an earlier incarnation, taken over;
  - otherwise the save fails naming the holder (host, pid, since when, its command) and how to
    clear a stale lock left by a job on another host (delete the file).

``load_checkpoint`` warns when its directory is locked by another live job (``warn_if_held``),
so that a job learns at its start, not at its first save, that it cannot save there.

Created with O_EXCL, so of two processes racing for a free lock one wins. Two processes taking
over one stale lock at the same instant could both succeed; each save checks that the lock
still names its process, so the loser fails at its next save instead of writing beside the
winner.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import sys
import time

from shardwise.checkpoint.manifest import CheckpointError

LOCK = ".shardwise-lock"
logger = logging.getLogger("shardwise")
_held: set[str] = set()  # lock files this process created


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, Linux), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _job() -> str | None:
    """This job's id across restarts: Slurm's job id, else torchelastic's run id."""
    for var in ("SLURM_JOB_ID", "SLURM_JOBID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return None


def _me() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": _start_time(os.getpid()),
        "job": _job(),
        "since": time.time(),
        "argv": " ".join(sys.argv)[:200],
    }


def _alive(holder: dict) -> bool:
    """Whether the holder's process (on this host) still runs."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    started = _start_time(pid)
    return started is None or holder.get("pid_start") in (None, started)


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written, or damaged: an unknown holder
    return holder if isinstance(holder, dict) else {}


def _is_me(holder: dict) -> bool:
    me = _me()
    return all(holder.get(k) == me[k] for k in ("host", "pid", "pid_start"))


def _create(path: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(_me(), f)
        f.flush()
        os.fsync(f.fileno())
    _held.add(path)
    return True


def describe(holder: dict) -> str:
    if not holder:
        return "an unknown holder (the lock file is empty or damaged)"
    since = holder.get("since")
    when = (
        datetime.datetime.fromtimestamp(since).isoformat(timespec="seconds")
        if isinstance(since, (int, float))
        else "?"
    )
    return (
        f"host {holder.get('host')!r} pid {holder.get('pid')} (since {when}, "
        f"command {holder.get('argv', '?')!r})"
    )


def acquire(save_dir: str) -> None:
    """Hold the lock of ``save_dir`` (created if needed) or raise ``CheckpointError``."""
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK)
    for _ in range(3):  # a free lock, or a stale one removed, can be lost to a racing job
        holder = _read(path)
        if holder is None:
            if _create(path):
                return
            continue
        if _is_me(holder):
            _held.add(path)
            return
        why = _stale(holder)
        if not why:
            break
        logger.warning("%s: taking over the lock of %s, %s", save_dir, describe(holder), why)
        _remove(path)
    raise CheckpointError(
        f"{save_dir} is locked by another job: {describe(holder or {})}. Two jobs saving into "
        "one directory overwrite and rotate away each other's checkpoints; give this job "
        f"another save_dir. If that job is gone (it ran on another host, so its process cannot "
        f"be checked from here), delete {path} and save again"
    )


def _stale(holder: dict) -> str:
    """Why ``holder`` (not this process) no longer holds its lock; '' if it may."""
    if holder.get("host") == socket.gethostname() and not _alive(holder):
        return "whose process is gone"
    if holder.get("job") is not None and holder.get("job") == _job():
        return "an earlier run of this job (same " + str(holder["job"]).split("=")[0] + ")"
    return ""


def warn_if_held(save_dir: str) -> None:
    """Warn if another live job holds ``save_dir``'s lock: this job's saves there will fail."""
    holder = _read(os.path.join(save_dir, LOCK))
    if holder is not None and not _is_me(holder) and not _stale(holder):
        logger.warning(
            "%s is locked by another job (%s): saves into it will be refused while that job "
            "holds it",
            save_dir,
            describe(holder),
        )


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


@atexit.register
def release_all() -> None:
    """Remove the locks this process holds (at exit)."""
    for path in list(_held):
        holder = _read(path)
        if holder is not None and _is_me(holder):
            _remove(path)
        _held.discard(path)
