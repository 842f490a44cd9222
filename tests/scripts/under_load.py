"""Run a command beside a bounded CPU burner: ``make test-stress`` runs the suite this way.

    python tests/scripts/under_load.py [--burners N] [--seconds S] -- COMMAND ...

Starts N busy-looping processes (default: twice the cores), runs COMMAND, then stops them and
exits with COMMAND's exit code. Each burner also stops by itself after S seconds or as soon as
this script is gone, so a killed run leaves nothing spinning. COMMAND gets the time scale of
tests/waits.py set for the load it will meet: with N burners and the suite's own work (about
one core) sharing C cores, a process runs roughly (N + C) / C times slower than alone.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time


def burn(parent: int, seconds: float) -> None:
    """Spin until ``seconds`` have passed or ``parent`` has exited, in a session of its own."""
    # Another job's work, as on a busy machine, not the suite's. Left in the suite's session
    # (one scheduler autogroup with it), the burners starved every process that starts a
    # session of its own, as torchrun's workers do: beside 4 burners a setsid spinner got 0.9%
    # of a core while one in the suite's session got 29%, and the preemption tests' jobs never
    # reached step 3 in 270 s. In their own sessions: 11% and 11%, a fair share.
    os.setsid()
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        for _ in range(200_000):  # about 10 ms of work between checks
            x += 1
        if os.getppid() != parent:
            return


def main() -> int:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burners", type=int, default=2 * cores)
    p.add_argument("--seconds", type=float, default=3600.0, help="each burner's own limit")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    burners = [
        mp.Process(target=burn, args=(os.getpid(), args.seconds), daemon=True)
        for _ in range(args.burners)
    ]
    for b in burners:
        b.start()
    scale = (args.burners + cores) / cores
    env = {**os.environ, "SHARDWISE_TEST_TIME_SCALE": os.environ.get(
        "SHARDWISE_TEST_TIME_SCALE", f"{scale:g}")}  # fmt: skip
    print(f"under_load: {args.burners} burners on {cores} cores, time scale "
          f"{env['SHARDWISE_TEST_TIME_SCALE']}: {' '.join(command)}", flush=True)  # fmt: skip
    start = time.monotonic()
    try:
        code = subprocess.call(command, env=env)
    finally:
        for b in burners:
            b.terminate()
        for b in burners:
            b.join(5)
    print(f"under_load: exit {code} after {time.monotonic() - start:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
