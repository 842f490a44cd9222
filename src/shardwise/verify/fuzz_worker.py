"""One rank of a ``shardwise verify --fuzz`` case, started by ``fuzz_run`` through ``shardwise
run`` (``python -m shardwise.verify.fuzz_worker SCRIPT --case JSON ...``): the case's setup
and layout, trained as ``worker.py`` trains a named layout."""

from __future__ import annotations

from collections.abc import Sequence

from shardwise.verify.fuzz_run import run_case_worker
from shardwise.verify.worker import worker_args


def main(argv: Sequence[str] | None = None) -> None:
    args = worker_args("one case of shardwise verify --fuzz", "case", "the case (JSON)", argv)
    run_case_worker(args.script, args.entry, args.case, args.steps, args.init, args.out)


if __name__ == "__main__":
    main()
