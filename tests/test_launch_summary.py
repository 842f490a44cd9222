"""The lines ``shardwise run`` prints first (issue 15): the resolved world and master before
anything starts, and the first failing rank before torchrun's per-rank records.

The real launches are in test_launch_guard.py; here each rule is pinned on its own, the
failure read from a real torchelastic error file of the kind a worker writes.
"""

from __future__ import annotations

import json
import socket

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shardwise.launch.cli import make_parser
from shardwise.launch.run import build_torchrun_argv
from shardwise.launch.summary import first_failure, opening_line

# (case, flags, the line's start)
OPENINGS = [
    ("one node", "--nproc-per-node 2 t.py",
     "shardwise run: 1 node x 2 processes = world 2, master on this host (standalone"),
    ("two nodes", "--nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr n0 t.py",
     "shardwise run: 2 nodes x 4 processes = world 8, master n0:29500 (node rank 1)"),
    ("elastic", "--nnodes 1:2 --nproc-per-node 2 --master-addr n0 t.py",
     "shardwise run: 1 to 2 nodes x 2 processes = world 4, c10d rendezvous at n0:29500;"),
    ("explicit port", "--master-port 29700 t.py",
     "shardwise run: 1 node x 1 process = world 1, master 127.0.0.1:29700;"),
]  # fmt: skip


@pytest.mark.parametrize("case,flags,start", OPENINGS, ids=[c[0] for c in OPENINGS])
def test_the_opening_line_names_world_and_master(case, flags, start):
    args = make_parser().parse_args(["run", *flags.split()])
    argv = build_torchrun_argv(args)
    line = opening_line(args, argv)
    assert line.startswith(start), f"{case}: {line}"
    assert line.endswith("t.py"), f"{case}: the torchrun command closes the line: {line}"


def _failure(tmp_path, local_rank: int, exitcode: int, message: str | None) -> ProcessFailure:
    path = tmp_path / f"error-{local_rank}.json"
    if message is not None:
        data = {"message": {"message": message, "extraInfo": {"timestamp": "1"}}}
        path.write_text(json.dumps(data))
    return ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode,
                          error_file=str(path))  # fmt: skip


def test_the_first_failure_is_named_with_its_exception(tmp_path):
    trace = "Traceback (most recent call last):\n  File x.py\nValueError: rank 3 gave up"
    failures = {3: _failure(tmp_path, 1, 1, trace), 2: _failure(tmp_path, 0, -15, None)}
    failures[2].timestamp = failures[3].timestamp + 5  # SIGTERMed after rank 3 failed
    line = first_failure(ChildFailedError("train.py", failures))
    host = socket.gethostname()
    assert line == (
        f"shardwise run: rank 3 (local rank 1, host {host}) failed first: ValueError: rank 3 gave up"
    ), line


def test_a_rank_without_an_error_file_is_named_by_its_exit(tmp_path):
    line = first_failure(ChildFailedError("train.py", {0: _failure(tmp_path, 0, 7, None)}))
    assert line.endswith("failed first: exit code 7, no exception recorded"), line
    line = first_failure(ChildFailedError("train.py", {0: _failure(tmp_path, 0, -9, None)}))
    assert "Signal 9 (SIGKILL)" in line, line
