"""One rank of a ``shardwise verify --fuzz`` case, started by ``fuzz_run`` through ``shardwise
run`` (``python -m shardwise.verify.fuzz_worker SCRIPT --case JSON ...``): the case's setup
and layout, trained as ``worker.py`` trains a named layout."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from shardwise.verify.fuzz_run import run_case_worker
from shardwise.verify.setup import DEFAULT_ENTRY


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one case of shardwise verify --fuzz")
    p.add_argument("script")
    p.add_argument("--case", required=True, help="the case (JSON): its setup and layout")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--init", required=True, help="safetensors file of the initial weights")
    p.add_argument("--out", required=True)
    p.add_argument("--entry", default=DEFAULT_ENTRY)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one thread per rank, as the reference: repeatable bit for bit
    run_case_worker(args.script, args.entry, args.case, args.steps, args.init, args.out)


if __name__ == "__main__":
    main()
