"""How often a finished job fails at exit: N launches of a 2-rank script that never tears down
its process group (tests/scripts/exit_plain.py, as DeepSpeed scripts do), counting non-zero
exits and the SIGABRTs among them (issue 13: "training finished, job failed").

    python benchmarks/clean_exit.py --runs 100
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "exit_plain.py"


def launch_once(nproc: int = 2, timeout: float = 600) -> tuple[int, str]:
    """One launch: (exit code, the tail of its stderr)."""
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", str(nproc), str(SCRIPT)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stderr[-2000:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    failed, aborted, start = 0, 0, time.perf_counter()
    for i in range(args.runs):
        code, err = launch_once()
        if code != 0:
            failed += 1
            aborted += "SIGABRT" in err or "terminate called" in err
            print(f"run {i}: exit {code}\n{err}", file=sys.stderr)
    took = time.perf_counter() - start
    print(
        f"clean_exit: {args.runs - failed}/{args.runs} runs exited 0 ({aborted} SIGABRT), {took:.0f} s"
    )


if __name__ == "__main__":
    main()
