"""What a worker started by ``shardwise run`` arranges for itself once its world is up.

* **It dies with its launcher.** ``shardwise run`` exports its pid (``SHARDWISE_LAUNCHER_PID``);
  a worker whose parent is that launcher asks Linux to send it SIGTERM when the parent dies
  (``prctl(PR_SET_PDEATHSIG)``). Without it a SIGKILLed launcher left its workers training and
  writing checkpoints, and a relaunch into the same directory then had two writers. A worker
  whose parent is someone else (a wrapper script) is left alone: the signal would follow the
  wrong process.
* **Its uncaught exception reaches the launcher's summary.** torchrun reads a per-worker error
  file (``TORCHELASTIC_ERROR_FILE``) for its "Root Cause" section; workers that are not wrapped
  in torch's ``@record`` leave it empty (``error_file: <N/A>``). An ``excepthook`` writes the
  exception and its traceback there in torch's format, then runs the previous hook.
* **A restart is not silent.** torchrun logs "N/M attempts left; will restart" at INFO only,
  hidden at the default level; rank 0 of a restarted group says which attempt it is.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from types import TracebackType

LAUNCHER_VAR = "SHARDWISE_LAUNCHER_PID"
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
_PR_SET_PDEATHSIG = 1


def die_with_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """Arm SIGTERM on the launcher's death when it is this process's parent; True if armed.
    A launcher that died before the signal was armed is noticed by the parent changing."""
    launcher = environ.get(LAUNCHER_VAR, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return False
    if os.getppid() != int(launcher):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    if os.getppid() != int(launcher):  # it died in between: nobody will send the signal
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def write_error_file(path: str, error: BaseException, tb: TracebackType | None) -> None:
    """``error`` in the JSON torchrun's failure summary reads (torch's ``ErrorHandler``)."""
    data = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(error), error, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    with open(path, "w") as f:
        json.dump(data, f)


def record_uncaught_errors(environ: Mapping[str, str] = os.environ) -> bool:
    """Install the excepthook that fills torchrun's error file; True if there is one to fill."""
    path = environ.get(ERROR_FILE_VAR)
    if not path or getattr(sys.excepthook, "_shardwise_records", False):
        return bool(path)
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        try:
            write_error_file(path, error, tb)
        except OSError:
            pass  # the summary loses the message; the traceback below still prints
        previous(kind, error, tb)

    hook._shardwise_records = True  # type: ignore[attr-defined]
    sys.excepthook = hook
    return True


def restart_notice(rank: int, environ: Mapping[str, str] = os.environ) -> str | None:
    """The line rank 0 prints when torchrun restarted its worker group, else None."""
    count = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    most = environ.get("TORCHELASTIC_MAX_RESTARTS", "")
    if rank != 0 or not count.isdigit() or int(count) == 0:
        return None
    of = f" of {most}" if most.isdigit() else ""
    return f"[shardwise] worker group restarted: attempt {count}{of}"


def guard_worker(rank: int) -> None:
    """All of the above (the module docstring says why)."""
    die_with_launcher()
    record_uncaught_errors()
    notice = restart_notice(rank)
    if notice:
        print(notice, file=sys.stderr, flush=True)
