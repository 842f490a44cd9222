"""A tiny distributed job for the launcher tests: every rank all-reduces rank + 1.

Prints one line per rank, e.g. ``hello rank=1 world=2 local_rank=1 launcher=torchrun sum=3 ...``.
``--fail-once MARKER``: the first attempt creates MARKER and rank 0 exits with code 3, so that
``--max-restarts 1`` has something to restart.
"""

import argparse
import os
import sys
from pathlib import Path


def say(line: str) -> None:
    # One write per line: the ranks share one pipe, and a single short write is never split.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-once", default=None)
    parser.add_argument("--local_rank", type=int, default=None)  # only with --local-rank-arg
    args = parser.parse_args()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    marker = Path(args.fail_once) if args.fail_once else None
    if marker and os.environ.get("RANK") == "0" and not marker.exists():
        # Fail before importing torch: the test waits for the restart, not for this import.
        marker.touch()
        say(f"failing on purpose rank=0 restart={restart}")
        sys.exit(3)

    import torch
    import torch.distributed as dist

    from shardwise.launch.env import init_distributed

    env = init_distributed(verbose=False)
    total = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(total)
    say(
        f"hello rank={env.rank} world={env.world_size} local_rank={env.local_rank} "
        f"launcher={env.launcher} sum={int(total.item())} restart={restart} "
        f"local_rank_arg={args.local_rank} omp={os.environ.get('OMP_NUM_THREADS')}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
