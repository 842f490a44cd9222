"""The flight recorder: the last N collective and point-to-point calls of this process.

Every call that ``shardwise.comm`` sends over a group of two or more ranks is recorded when it
starts and closed when it ends (an async call: when its handle's ``wait()`` returns):

    seq       the n-th call this rank made on that group. Every member of a group makes the
              same calls in the same order (gloo and NCCL pair them by that order), so call n of
              one rank meets call n of the others. Point-to-point messages are numbered per
              direction: ``world p2p 0->1`` #5 is the fifth message rank 0 sends rank 1.
    op, group name and global ranks, shapes and dtypes of the tensors, bytes, start and end
    (``time.time()``), the Python line that called ``shardwise.comm`` and the thread.

Calls in flight are also kept apart, for the watchdog (``watchdog.py``): it is the one that
notices a call older than the group's timeout and makes every rank write what it holds.
Per group, the recorder counts the calls entered and completed, and the calls per call site,
for as long as the process lives (the ring of recent calls forgets, the counts do not).

Cost per call: about 3 microseconds of Python (docs/reliability.md has the measured share of a
training step). ``configure(size=0)`` turns it off, and the watchdog with it.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from shardwise.diagnose import fingerprint
from shardwise.diagnose.calls import Call, GroupInfo
from shardwise.diagnose.watchdog import Watchdog
from shardwise.topology import world_timeout

DEFAULT_SIZE = 256
P2P = ("send", "recv")
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Frames skipped to find the caller: shardwise.comm and this package.
_COMM_FILE = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "comm.py")
# Errors that mean a peer did not come (gloo's, and torch DETAIL mode's monitored barrier).
_HANG_WORDS = (
    "timed out",
    "timeout",
    "connection",
    "closed by peer",
    "broken pipe",
    "monitoredbarrier",
)


def _skipped(path: str) -> bool:
    return path == _COMM_FILE or path.startswith(_HERE)


def _site() -> tuple[str, int, str]:
    """The innermost frame outside shardwise.comm and this package: who called the collective."""
    f = sys._getframe(2)
    while f is not None and _skipped(f.f_code.co_filename):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno, f.f_code.co_name) if f is not None else ("?", 0, "?")


def _timeout_of(pg: dist.ProcessGroup | None) -> float:
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        t = world_timeout()
        return t.total_seconds() if t is not None else 1800.0


class FlightRecorder:
    """The process's record of its calls; ``shardwise.comm`` owns the one instance."""

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self.calls: collections.deque[Call] = collections.deque(maxlen=max(size, 1))
        self.enabled = size > 0
        self.open: dict[int, Call] = {}
        self.sites: collections.Counter = collections.Counter()  # (group, op, site) -> calls
        self.fingerprint = False
        self.watch = True
        self.run_dir: str | None = None
        self.watchdog: Watchdog | None = None
        self._groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._channels: dict[tuple, GroupInfo] = {}
        self._lock = threading.Lock()

    def configure(
        self,
        size: int | None = None,
        watchdog: bool | None = None,
        fingerprint: bool | None = None,
        run_dir: str | None = None,
    ) -> None:
        """``size`` calls kept (0: recorder and watchdog off); the watchdog; the fingerprint
        check before every collective; where the watchdog writes (``diagnose/`` under it)."""
        if size is not None:
            self.enabled = size > 0
            self.calls = collections.deque(self.calls, maxlen=max(size, 1))
        if watchdog is not None:
            self.watch = watchdog
            if not watchdog and self.watchdog is not None:
                self.watchdog.close()
                self.watchdog = None
        if fingerprint is not None:
            self.fingerprint = fingerprint
        if run_dir is not None:
            self.run_dir = run_dir
            if self.watchdog is not None:
                self.watchdog.run_dir = run_dir

    # ------------------------------------------------------------------ the hot path

    def begin(self, op: str, nbytes: int, args: tuple, kw: dict) -> Call | None:
        """Record a call about to be issued (``args``/``kw`` as given to torch.distributed,
        the group as ``group=``); with ``fingerprint`` on, check it against the group's."""
        if not self.enabled:
            return None
        pg = kw.get("group")
        pg = dist.group.WORLD if pg is None else pg
        if pg is None:  # no world: torch raises its own error
            return None
        info = self._groups.get(pg) or self._describe(pg)
        if op in P2P:
            info = self._channel(info, op, args[1])
        info.entered += 1
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        call = Call(
            info.entered,
            op,
            info,
            nbytes,
            tuple(tuple(t.shape) for t in tensors),
            tuple(t.dtype for t in tensors),
            _site(),
            threading.get_ident(),
            time.time(),
        )
        self.calls.append(call)
        self.open[id(call)] = call
        self.sites[(info, op, call.site)] += 1
        if self.watchdog is None and self.watch:
            self._start_watchdog()
        if self.fingerprint and op not in P2P:
            try:
                fingerprint.check(
                    call, pg, symmetric=op != "all_to_all" or args[2:4] == (None, None)
                )
            except BaseException as e:
                self.end(call, error=str(e))
                raise
        return call

    def end(self, call: Call | None, error: str | None = None) -> None:
        if call is None or call.end is not None:
            return
        call.end, call.error, call.work = time.time(), error, None
        self.open.pop(id(call), None)
        if error is None and call.seq > call.group.completed:
            call.group.completed = call.seq

    def finished(self, call: Call | None, out: Any) -> Any:
        """Close a blocking call; an async one's handle is wrapped to close it on ``wait()``."""
        if call is None:
            return out
        if out is not None and hasattr(out, "wait"):
            call.work = out
            return TrackedWork(out, call, self)
        self.end(call)
        return out

    def failed(self, call: Call | None, error: BaseException) -> BaseException | None:
        """The error to raise instead of ``error`` (None: raise it as is): the same type, its
        message prefixed with the call and group; a timeout or a lost peer waits for the
        watchdog's diagnosis (every rank's record, merged) and adds its conclusion."""
        if call is None:
            return None
        self.end(call, error=str(error))
        text = str(error)
        msg = f"{call.describe()} failed on this rank after {call.end - call.start:.1f} s: {text}"
        hang = any(w in text.lower() for w in _HANG_WORDS)
        if self.watchdog is not None and (hang or self.watchdog.fired):
            conclusion = self.watchdog.diagnose(f"{call.describe()} failed: {text[:200]}")
            if conclusion:
                msg += f"\n{conclusion}"
        try:
            return type(error)(msg)
        except TypeError:  # an exception type that wants other arguments
            return RuntimeError(msg)

    # ------------------------------------------------------------------ queries

    def recent(self) -> list[Call]:
        return list(self.calls)

    def in_flight(self) -> list[Call]:
        return list(self.open.values())

    def groups(self) -> list[GroupInfo]:
        with self._lock:
            infos = list(self._groups.values()) + list(self._channels.values())
        return [g for g in infos if g.entered]

    # ------------------------------------------------------------------ helpers

    def _describe(self, pg: dist.ProcessGroup | None) -> GroupInfo:
        ranks = tuple(dist.get_process_group_ranks(pg))
        desc = getattr(pg, "group_desc", "") or ""
        if pg is dist.group.WORLD or desc == "default_pg":
            name = "world"
        else:
            name = desc if desc and desc != "undefined" else f"group{list(ranks)}"
        info = GroupInfo(name, ranks, _timeout_of(pg))
        with self._lock:
            self._groups[pg] = info
        return info

    def _channel(self, info: GroupInfo, op: str, peer: int | None) -> GroupInfo:
        me = dist.get_rank()
        src, dst = (me, peer) if op == "send" else (peer, me)
        key = (info.name, info.ranks, src, dst)
        channel = self._channels.get(key)
        if channel is None:
            name = f"{info.name} p2p {'*' if src is None else src}->{dst}"
            ranks = (dst,) if src is None else (src, dst)
            channel = GroupInfo(name, ranks, info.timeout)
            with self._lock:
                self._channels[key] = channel
        return channel

    def arm(self) -> None:
        """Start the watchdog now (``init_distributed`` does, once the world is up): a rank
        that hangs before its first collective must still answer the others."""
        if self.enabled and self.watch and self.watchdog is None and dist.is_initialized():
            if dist.get_world_size() > 1:
                self._start_watchdog()

    def disarm(self) -> None:
        """Stop the watchdog before the world it watches is torn down: its thread polls the
        job's store, and a thread inside a store call when the interpreter finalizes dies in
        pybind11's GIL re-acquire (SIGABRT). The next collective starts a new one."""
        with self._lock:
            watchdog, self.watchdog = self.watchdog, None
        if watchdog is not None:
            watchdog.close()

    def _start_watchdog(self) -> None:
        with self._lock:
            if self.watchdog is None:
                self.watchdog = Watchdog(self, dist.get_rank(), dist.get_world_size())
                self.watchdog.run_dir = self.run_dir
                self.watchdog.start()


class TrackedWork:
    """An async call's handle: closes its record when ``wait()`` returns (or the handle says
    it completed) and names the call in its errors; anything else goes to the handle."""

    __slots__ = ("_call", "_rec", "_work")

    def __init__(self, work: dist.Work, call: Call, recorder: FlightRecorder) -> None:
        self._work, self._call, self._rec = work, call, recorder

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = self._work.wait(*args, **kwargs)
        except RuntimeError as e:
            wrapped = self._rec.failed(self._call, e)
            if wrapped is None:
                raise
            raise wrapped from e
        self._rec.end(self._call)
        return out

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._rec.end(self._call)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


# One recorder per process, like the process's own collectives (comm.py books every call in
# it): made on first use so that importing this module starts nothing.
_PROCESS: list[FlightRecorder] = []


def process_recorder() -> FlightRecorder:
    """This process's flight recorder (``comm.recorder()`` returns the same object)."""
    if not _PROCESS:
        _PROCESS.append(FlightRecorder())
    return _PROCESS[0]
