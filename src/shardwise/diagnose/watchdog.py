"""The watchdog: a daemon thread per rank that turns a hang into a report.

1. It notices a call of this rank in flight longer than its group's timeout minus a margin
   (20% of the timeout, between 1 and 10 s), so before gloo raises; or it is woken by a
   collective that failed with a timeout or a lost peer (``diagnose``).
2. It publishes the hang in the job's c10d store (the one every rank already shares; under
   ``shardwise run`` it lives in the launcher, so it outlives the workers). Every rank's watchdog
   polls that key (every quarter of the margin, at most once a second), so a rank that waits
   in no collective (asleep, computing, blocked elsewhere) learns of the hang too: a thread
   runs while the main thread sleeps or waits in C++ (both release the GIL).
3. Every rank writes its record (``dump.py``) to the diagnose dir and puts it in the store,
   and logs one line with the innermost frames of its waiting (else main) thread.
4. Rank 0 collects the records (up to ``WINDOW`` s for the missing ones), writes
   ``report.txt`` beside them, prints it to stderr and publishes its conclusion; if rank 0 has
   not answered by then, the first other rank to claim the report does it. A collective that
   fails on this rank carries that conclusion in its error.

If the reporter is stopped before it finishes, ``shardwise run`` writes the report from the
records once the job has failed (``report.settle``). The watchdog stops there, once per process. gloo raises in the waiting ranks at the timeout,
the error (with the conclusion) reaches torchrun's failure summary and the launcher stops the
others: the job exits non-zero. Without a store (MPI), each rank writes its file and rank 0
merges the files it can see.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise.diagnose import dump, report
from shardwise.diagnose.calls import CallLog
from shardwise.topology import world_timeout

_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
WINDOW = 3.0  # seconds the reporter waits for the records that are missing
STACK_LINES = 8  # innermost frames of the waiting thread each rank logs


def margin(timeout: float) -> float:
    """How long before the group's timeout a call counts as hung."""
    return min(max(0.2 * timeout, 1.0), 10.0, timeout / 2)


def _ours(path: str) -> bool:
    """A frame of this package or of ``threading`` (the wait for the diagnosis itself)."""
    return path.startswith(_HERE) or path == threading.__file__


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except (RuntimeError, ValueError, AttributeError):
        return None


def _call(store: dist.Store, method: str, *args: Any) -> Any:
    """A store operation that never raises (None on failure: the store may be gone)."""
    if store is None:
        return None
    try:
        return getattr(store, method)(*args)
    except Exception:  # noqa: BLE001 - a dead store must not kill the diagnosis
        return None


class Watchdog:
    """The thread of one rank (the module docstring tells what it does)."""

    def __init__(self, recorder: CallLog, rank: int, world_size: int) -> None:
        self.recorder, self.rank, self.world_size = recorder, rank, world_size
        self.run_dir: str | None = None
        timeout = world_timeout()
        seconds = timeout.total_seconds() if timeout is not None else 1800.0
        self.poll = min(max(margin(seconds) / 4, 0.05), 1.0)
        self.window = WINDOW
        self.done = threading.Event()
        self.conclusion: str | None = None
        self.fired = False  # a diagnosis is under way or done
        self._reason: str | None = None
        self._stop = False
        self._wake = threading.Event()
        self._prefix = f"shardwise/diagnose/{dump.job_id()}/"
        self._thread = threading.Thread(target=self._run, name="shardwise-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self.close)  # before torch tears the world down (atexit runs LIFO)

    def close(self) -> None:
        if self.fired:  # let the report finish before the interpreter goes
            self.done.wait(2 * self.window + 2)
        self._stop = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def diagnose(self, reason: str) -> str | None:
        """Called by a thread whose collective failed: fire now (if not done yet), wait for
        the merged diagnosis and return its conclusion (None if there is none in time)."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return self.conclusion
        if not self.done.is_set():
            self._reason = self._reason or reason
            self._wake.set()
            self.done.wait(2 * self.window + 2 * self.poll + 2)
        return self.conclusion

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.poll)
            self._wake.clear()
            if self._stop:
                return
            mine = self._reason or self._overdue()
            theirs = None if mine else self._published()
            if mine or theirs:
                try:
                    self._fire(mine, theirs)
                except Exception as e:  # noqa: BLE001 - say it; the job goes on to its error
                    print(f"[shardwise] rank {self.rank}: diagnosis failed: {e!r}", file=sys.stderr)
                finally:
                    self.done.set()
                return

    def _overdue(self) -> str | None:
        now = time.time()
        for call in self.recorder.in_flight():
            if call.work is not None and _call(call.work, "is_completed"):
                self.recorder.end(call)  # an async call nobody waited for
                continue
            limit = call.group.timeout
            if now - call.start > limit - margin(limit):
                return f"{call.describe()} in flight for {now - call.start:.1f} s (timeout {limit:g} s)"
        return None

    def _published(self) -> dict | None:
        store = _store()
        if not _call(store, "check", [self._prefix + "hang"]):
            return None
        raw = _call(store, "get", self._prefix + "hang")
        return json.loads(raw) if raw else None

    def _fire(self, mine: str | None, theirs: dict | None) -> None:
        self.fired = True
        store, started = _store(), time.time()
        if mine:
            _call(
                store, "set", self._prefix + "hang", json.dumps({"rank": self.rank, "reason": mine})
            )
        reason = mine or f"rank {theirs['rank']} saw a hang: {theirs['reason']}"
        data = dump.record(self.recorder, self.rank, self.world_size, reason, threading.get_ident())
        directory = dump.diagnose_dir(self.run_dir)
        path = dump.write(directory, data)
        _call(store, "set", self._prefix + f"rank{self.rank}", json.dumps(data))
        _call(store, "add", self._prefix + "count", 1)
        frames = [f for f in data["stacks"].get(data["thread"], []) if not _ours(f[0])]
        frames = frames[-STACK_LINES:]
        stack = "".join(f"\n    {report.frame_text(f)}" for f in frames)
        print(
            f"[shardwise] rank {self.rank}: {reason}; wrote {path}; {data['thread']} is at:{stack}",
            file=sys.stderr,
            flush=True,
        )
        if self.rank == 0:
            _call(store, "compare_set", self._prefix + "reporter", "", "0")  # others: stand by
            self._report(store, directory, data, started)
        elif store is not None:  # rank 0 reports; if it says nothing in time, the first to claim
            self.conclusion = self._await(store, self._prefix + "conclusion", self.window + 1)
            claim = _call(store, "compare_set", self._prefix + "reporter", "", str(self.rank))
            if self.conclusion is None and claim == str(self.rank).encode():
                self._report(store, directory, data, started)

    def _await(self, store: dist.Store, key: str, seconds: float) -> str | None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            if _call(store, "check", [key]):
                raw = _call(store, "get", key)
                return raw.decode() if raw else None
            time.sleep(0.1)
        return None

    def _collect(
        self, store: dist.Store, directory: Path, mine: dict, started: float
    ) -> dict[int, dict]:
        """Every rank's record that arrives within the window (store first, then files)."""
        deadline = started + self.window
        while time.time() < deadline:
            count = _call(store, "add", self._prefix + "count", 0)
            if count is not None and count >= self.world_size:
                break
            if count is None and len(list(directory.glob("rank*.json"))) >= self.world_size:
                break
            time.sleep(0.1)
        records = {self.rank: mine}
        for r in range(self.world_size):
            key = self._prefix + f"rank{r}"
            if r not in records and _call(store, "check", [key]):
                records[r] = json.loads(_call(store, "get", key))
        for r, data in report.read_dir(directory, job=mine["job"], since=started - 60).items():
            records.setdefault(r, data)
        return records

    def _report(self, store: dist.Store, directory: Path, mine: dict, started: float) -> None:
        records = self._collect(store, directory, mine, started)
        for r, data in records.items():  # records from other nodes, beside this node's
            if not (directory / f"rank{r}.json").exists():
                dump.write(directory, data)
        text = report.format_report(records, self.world_size, str(directory))
        report.write_report(directory, text)
        print(text, file=sys.stderr, flush=True)
        found = report.conclusion(records, self.world_size)
        self.conclusion = f"{found}\n(report: {directory / 'report.txt'})"
        _call(store, "set", self._prefix + "conclusion", self.conclusion)
