"""A worker for the launcher-guard tests: joins the world, writes its pid, then either lingers
(``--linger``: sleeps, as a training job would keep going) or raises on rank 1 (``--raise``)."""

import argparse
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pid_dir")
    parser.add_argument("--raise", dest="fail", action="store_true")
    args = parser.parse_args()

    from shardwise.launch.env import init_distributed

    env = init_distributed(verbose=False)
    Path(args.pid_dir, f"rank{env.rank}.pid").write_text(str(os.getpid()))
    if args.fail and env.rank == 1:
        raise ValueError("rank 1 gave up on purpose (shardwise-guard-test)")
    time.sleep(120 if not args.fail else 0)


if __name__ == "__main__":
    main()
