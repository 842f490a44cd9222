"""Every wait of the suite scales from here, so a loaded machine makes tests slower, not red.

A wait is any number of seconds a test gives something to happen: a subprocess or world
timeout, a polling deadline, a heartbeat or collective limit handed to the code under test, a
sleep that orders two events. On a quiet 2-core machine the written values hold with margin;
under load (CI beside other jobs, ``make test-stress``) a process can lose the CPU for seconds,
so each wait is multiplied by one factor:

    SCALE = SHARDWISE_TEST_TIME_SCALE if set, else max(1, load average over 1 min / cores),
            capped at MAX_AUTO_SCALE
    a wait = seconds x max(SCALE, load average over 1 min / cores now, capped at MAX_AUTO_SCALE)

SCALE is read once, when the suite starts (``make test-stress`` sets it for its burner), and is
a floor: each wait also reads the load when it is taken, since other work can start on the
machine after the suite did (a stress run beside a developer's own tests lost a job's start
for over 270 s: the floor 3 was too low for the load of 8.5 per core it met). Waits only ever
lengthen: a test
whose point is that something happens *quickly* (a host named within the heartbeat limit plus a
beat) scales the limit it hands to the code as well as its own bound, so the claim it checks is
unchanged in units of the limit.
"""

from __future__ import annotations

import os

MAX_AUTO_SCALE = 6.0


def _scale() -> float:
    forced = os.environ.get("SHARDWISE_TEST_TIME_SCALE")
    if forced:
        value = float(forced)
        if value < 1:
            raise ValueError(f"SHARDWISE_TEST_TIME_SCALE={forced}: use a factor >= 1")
        return value
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    return min(max(1.0, load / (os.cpu_count() or 1)), MAX_AUTO_SCALE)


SCALE = _scale()
# Children (launched scripts, harness workers) see the same factor, not their own reading.
os.environ["SHARDWISE_TEST_TIME_SCALE"] = str(SCALE)


def now() -> float:
    """The factor of a wait taken now: SCALE, or the load per core if higher (capped)."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return SCALE
    return max(SCALE, min(load, MAX_AUTO_SCALE))


def scaled(seconds: float) -> float:
    """``seconds`` stretched by the time scale of this moment (module docstring)."""
    return seconds * now()


def scaled_int(seconds: float) -> int:
    """``scaled`` rounded up, for limits passed as whole seconds (environment variables)."""
    return int(-(-scaled(seconds) // 1))
