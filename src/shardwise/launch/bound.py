"""Run a training script pinned to this local rank's share of the cores (``--bind_cores_to_rank``).

``shardwise run --bind_cores_to_rank [--bind_core_list 0,2-5]`` starts every worker as
``python -m shardwise.launch.bound [--as-module] SCRIPT ARGS...`` with ``SHARDWISE_CORE_BINDING``
holding one core list per local rank ("0,1;2,3"): the worker pins itself
(``os.sched_setaffinity``) and runs the script as its ``__main__``. DeepSpeed's launcher does the
same with ``numactl``; this needs nothing installed. ``OMP_NUM_THREADS`` is set by the launcher
to the cores of one rank.
"""

from __future__ import annotations

import os
import runpy
import sys

BINDING_VAR = "SHARDWISE_CORE_BINDING"


def parse_core_list(text: str) -> list[int]:
    """DeepSpeed's ``--bind_core_list`` syntax: "0,2-5,8" -> [0, 2, 3, 4, 5, 8]."""
    cores: list[int] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        first, dash, last = item.partition("-")
        bad = not first.isdigit() or (dash and not last.isdigit())
        if bad or int(last or first) < int(first):
            raise ValueError(f"--bind_core_list {text!r}: {item!r} is not N or N-M (N <= M)")
        cores += range(int(first), int(last or first) + 1)
    if len(set(cores)) != len(cores) or not cores:
        raise ValueError(f"--bind_core_list {text!r}: give each core once, at least one")
    return cores


def split_cores(cores: list[int], ranks: int) -> list[list[int]]:
    """``cores`` in ``ranks`` equal consecutive shares (DeepSpeed's rule; the rest unused)."""
    each = len(cores) // ranks
    if each == 0:
        raise ValueError(f"--bind_cores_to_rank: {len(cores)} cores for {ranks} processes per node")
    return [cores[r * each : (r + 1) * each] for r in range(ranks)]


def main(argv: list[str]) -> None:
    shares = os.environ[BINDING_VAR].split(";")
    cores = [int(c) for c in shares[int(os.environ.get("LOCAL_RANK", "0"))].split(",")]
    os.sched_setaffinity(0, cores)
    as_module = argv[:1] == ["--as-module"]
    target, *rest = argv[1:] if as_module else argv
    sys.argv = [target, *rest]
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
