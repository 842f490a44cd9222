"""Preemption: a SIGTERM stops every rank after the same step, that step is saved, and the job
exits with ``PREEMPTED_EXIT_CODE`` (training/checkpoints/autosave.py does the saving).

Worker side:

* ``SignalFlag`` catches SIGTERM; its handler only sets a flag (a handler that saved would run
  in the middle of a collective, on some ranks only).
* ``agree`` runs at the end of every optimizer step while a save directory is configured: one
  all-reduce of an int32 over the world, so a signal that reached only some ranks (or reached
  them at different moments of the step) stops all of them after the same step.
* ``Preempted`` (a ``SystemExit`` with the code) ends the process: no traceback, ``finally``
  blocks and atexit hooks run (the process group is torn down there, launch/env.py).
* Outside a training step (after the loop, before the first backward, in an evaluation), no
  step end would ever read the flag: a SIGTERM that no step picks up within ``IDLE_GRACE_S``
  raises ``on_idle()``'s exception in the main thread, so the job still exits with the code
  (without a new save: the last one stands) instead of waiting for torchrun's SIGKILL. A step
  that starts within the grace (a rank between two steps of its loop) cancels it, and the
  ranks then agree at its end as above.

Launcher side (launch/run.py): torchrun's agent, on SIGTERM, forwards it to the workers, waits
for them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default) and raises ``SignalException``;
the workers' exit codes are not visible from there, so each worker that exits preempted writes
a one-line JSON report into ``$SHARDWISE_PREEMPT_DIR`` (a directory the launcher made) and
the launcher reads them.

The code: 75 is ``EX_TEMPFAIL`` of BSD's sysexits.h, "a temporary failure: the user is
invited to retry later", which is what a preempted job is. It is distinct from 0, from 1
(Python's uncaught exception, torchrun's "workers failed"), from 2 (usage errors), from
126/127 (the shell's cannot-execute / not-found) and from 128+N, a process killed by signal N
(143 for SIGTERM, 137 for SIGKILL), so a requeue wrapper can tell "saved, run me again" from
a crash and from a kill before the save: ``[ $? -eq 75 ] && requeue``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import weakref
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import torch

from shardwise import comm
from shardwise.launch.guard import LAUNCHER_VAR

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (module docstring: why this number)
# Well under torchrun's 30 s between its SIGTERM and its SIGKILL, and far above the gap between
# two steps of a training loop (data loading, logging) that a step start ends.
IDLE_GRACE_S = 10.0
REPORT_DIR_VAR = "SHARDWISE_PREEMPT_DIR"


class Preempted(SystemExit):
    """Raised by ``engine.step()`` after saving the step a SIGTERM interrupted: the process
    exits with ``PREEMPTED_EXIT_CODE`` without a traceback (catch it to run code first)."""

    def __init__(self, step: int, checkpoint: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.checkpoint = step, checkpoint


class SignalFlag:
    """``received`` becomes True when ``signum`` arrives; nothing else happens in the handler.

    A handler set before (another engine's, the user's own) still runs after ours. Once this
    flag is closed or garbage-collected, the signal does what it did before (SIGTERM: the
    process ends), so a finished engine never swallows it.
    """

    def __init__(
        self,
        signum: int = signal.SIGTERM,
        on_idle: Callable[[], BaseException] | None = None,
        grace: float = IDLE_GRACE_S,
    ) -> None:
        self.signum, self.received, self.closed = signum, False, False
        self.on_idle, self.grace = on_idle, grace
        self.in_step, self.expired = False, False
        self._timer: threading.Timer | None = None
        self.installed = threading.current_thread() is threading.main_thread()
        if not self.installed:  # Python runs handlers in the main thread only
            return
        self._previous = signal.getsignal(signum)
        self._handler = _handler(weakref.ref(self), self._previous)
        signal.signal(signum, self._handler)

    def step_started(self) -> None:
        """A training step began: its end reads the flag (a pending idle exit is off)."""
        self.in_step = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def step_ended(self) -> None:
        self.in_step = False

    def arm_idle_exit(self) -> None:
        """The signal came outside a step: exit unless a step starts within the grace."""
        if self.on_idle is None or self.in_step or self._timer is not None:
            return
        self._timer = threading.Timer(self.grace, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        if self.in_step or self.closed:
            return
        self.expired = True
        # A real signal to the main thread (not interrupt_main): it also wakes a blocking
        # sleep or wait there, and our handler then raises on_idle() in that thread.
        signal.pthread_kill(threading.main_thread().ident, self.signum)

    def close(self) -> None:
        """Give the signal back to the handler set before this one (if ours is still set)."""
        if self._timer is not None:
            self._timer.cancel()
        if self.closed:
            return
        self.closed = True
        in_main = threading.current_thread() is threading.main_thread()
        if self.installed and in_main and signal.getsignal(self.signum) is self._handler:
            signal.signal(self.signum, self._previous)


Handler = Callable[[int, FrameType | None], Any]


def _handler(flag: weakref.ref[SignalFlag], previous: Handler | int | None) -> Handler:
    def handle(signum: int, frame: FrameType | None) -> None:
        live = flag()
        if live is not None and not live.closed:
            if live.expired and live.on_idle is not None:
                live.expired = False
                raise live.on_idle()
            live.received = True
            live.arm_idle_exit()
        if callable(previous):
            previous(signum, frame)
        elif (live is None or live.closed) and previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)  # what the signal would have done
            os.kill(os.getpid(), signum)

    return handle


def agree(received: bool, group: comm.Group = None) -> int:
    """How many ranks of ``group`` (default: the world) received the signal; the same number on
    every rank. One all-reduce of 4 bytes."""
    count = torch.tensor([int(received)], dtype=torch.int32)
    comm.all_reduce(count, op=comm.ReduceOp.SUM, group=group)
    return int(count.item())


def write_report(rank: int, report: dict, environ: Mapping[str, str] = os.environ) -> None:
    """Tell ``shardwise run`` (when it started this worker) what was saved before the exit.
    A launcher that is gone (SIGKILLed) cannot read it nor remove its folder: we remove it."""
    folder = environ.get(REPORT_DIR_VAR)
    if not folder or not os.path.isdir(folder):
        return
    if str(os.getppid()) != environ.get(LAUNCHER_VAR):
        shutil.rmtree(folder, ignore_errors=True)
        return
    tmp = os.path.join(folder, f".rank{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, os.path.join(folder, f"rank{rank}.json"))


def read_reports(folder: str) -> list[dict]:
    """The reports of the workers that exited preempted, by rank."""
    reports = []
    names = os.listdir(folder) if os.path.isdir(folder) else []
    for name in sorted(n for n in names if n.startswith("rank") and n.endswith(".json")):
        try:
            with open(os.path.join(folder, name)) as f:
                reports.append(json.load(f))
        except (OSError, ValueError):
            continue
    return reports
