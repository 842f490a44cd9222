"""Is the machine idle? A calibration or a benchmark timed while other jobs share the cores
measures the other jobs too (a calibration taken during a test run came out 3x slow)."""

from __future__ import annotations

import os
import time

BUSY = 0.15  # the busy share of CPU time above which the cores count as shared


def busy_share(seconds: float = 2.0) -> float:
    """The machine's busy share of CPU time over ``seconds`` (/proc/stat; 0 where absent)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait

    if not os.path.exists("/proc/stat"):
        return 0.0
    (t0, i0), _ = sample(), time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(limit_s: float, seconds: float = 2.0) -> float:
    """Wait (up to ``limit_s``) until other jobs leave the cores idle (busy share at most
    ``BUSY``, sampled over ``seconds``). Returns the last busy share seen."""
    deadline = time.monotonic() + limit_s
    busy = busy_share(seconds)
    while busy > BUSY and time.monotonic() < deadline:
        busy = busy_share(seconds)
    return busy
