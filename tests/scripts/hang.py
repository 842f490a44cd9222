"""A training loop that hangs on purpose, one way per KIND (tests/test_hang.py).

python -m shardwise run --nproc-per-node 2 --timeout 5 --run-dir RUN hang.py sleep-world

sleep-world  2 ranks: rank 1 sleeps before its first collective (world group)
sleep-data   4 ranks, data 2 x tensor 2: rank 3 sleeps before step 2's data all_reduce
skip         2 ranks: rank 1 skips step 1's all_reduce; all then meet at a barrier
extra        2 ranks: rank 0 makes one all_reduce more after step 1; all meet at a barrier
extra-slow-report  as extra, but rank 0's report never finishes (as when the launcher stops
             a reporter slowed by a loaded machine): the launcher writes it from the records
own          2 ranks: the script's own torch.distributed all_reduce on a group it made with
             dist.new_group (no timeout given); rank 1 sleeps instead
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import shardwise
from shardwise import comm
from shardwise.diagnose import report
from shardwise.topology import ProcessMesh, Topology

STEPS = 3


def grads(group=None) -> None:
    comm.all_reduce(torch.ones(4), group=group)  # the step's gradient all-reduce


def activations(group=None) -> None:
    comm.all_reduce(torch.ones(2, 3), group=group)  # the step's tensor-parallel all-reduce


def own_metrics(rank: int) -> None:
    """A script's own collective on its own group, through torch.distributed directly."""
    metrics = dist.new_group([0, 1], group_desc="metrics")
    grads()
    if rank == 1:
        time.sleep(3600)  # rank 1 never sends its metric
    dist.all_reduce(torch.ones(3), group=metrics)  # the script's own all-reduce


def train(kind: str, rank: int) -> None:
    if kind == "own":
        return own_metrics(rank)
    mesh = ProcessMesh.create(
        Topology.build(comm.get_world_size(), tp=2 if kind == "sleep-data" else 1)
    )
    for step in range(STEPS):
        if kind == "sleep-data":
            activations(mesh.tp_group)
        if step == 0 and rank == 1 and kind == "sleep-world":
            time.sleep(3600)  # rank 1 never comes
        if step == 2 and rank == 3 and kind == "sleep-data":
            time.sleep(3600)  # rank 3 never comes
        if not (step == 1 and rank == 1 and kind == "skip"):
            grads(mesh.dp_group)
        if step == 1 and rank == 0 and kind.startswith("extra"):
            comm.all_reduce(torch.zeros(4))  # one all-reduce more, on rank 0 only
    comm.barrier()  # the end of training: everyone meets


def slow_report(*args, **kwargs) -> str:
    time.sleep(3600)  # the reporter is stopped before it writes
    return ""


if __name__ == "__main__":
    shardwise.init_distributed(verbose=False)
    if sys.argv[1] == "extra-slow-report" and comm.get_rank() == 0:
        report.format_report = slow_report
    train(sys.argv[1], comm.get_rank())
    print(f"rank {comm.get_rank()} finished", flush=True)
