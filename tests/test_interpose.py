"""A script's own point-to-point calls under shardwise's cover of ``torch.distributed``
(src/shardwise/diagnose/interpose.py), on 2 gloo processes.

* ``dist.P2POp(dist.isend, ...)`` with ``dist.batch_isend_irecv``, as Megatron's
  p2p_communication and torch's pipelining write it, moves the data as without the cover (the
  covered ``isend`` used to be refused by torch's ``P2POp``, which checks ``op is isend``), and
  the flight recorder books one send and one receive, both closed once waited.
* The covered ``dist.isend``/``dist.irecv`` still work on their own and are booked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import run_distributed

from shardwise.diagnose.interpose import cover_torch_distributed, uncover_torch_distributed
from shardwise.diagnose.recorder import process_recorder


def _exchange(batched: bool) -> tuple[list[float], list[tuple[str, bool]]]:
    cover_torch_distributed()
    recorder, was_off = process_recorder(), not process_recorder().enabled
    if was_off:  # an earlier test in this world may have turned the recorder off
        recorder.configure(size=256)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        send, recv = torch.full((3,), float(rank)), torch.empty(3)
        # Calls seen before, held alive (a full ring frees the oldest, whose id a new call may
        # take); matched by identity, since seq counts per group.
        before = process_recorder().recent()
        seen = {id(c) for c in before}
        if batched:
            ops = [
                dist.P2POp(dist.isend, send, (rank + 1) % world),
                dist.P2POp(dist.irecv, recv, (rank - 1) % world),
            ]
            works = dist.batch_isend_irecv(ops)
        else:
            works = [dist.isend(send, (rank + 1) % world), dist.irecv(recv, (rank - 1) % world)]
        for work in works:
            work.wait()
        new = [c for c in process_recorder().recent() if id(c) not in seen]
        booked = [(c.op, c.end is not None) for c in new]
        return recv.tolist(), booked
    finally:
        uncover_torch_distributed()
        if was_off:
            recorder.configure(size=0)


def test_a_scripts_batched_p2p_ops_pass_through_the_cover_and_are_booked():
    for batched in (True, False):
        case = "P2POp + batch_isend_irecv" if batched else "isend/irecv"
        for rank, (got, booked) in enumerate(run_distributed(_exchange, 2, batched)):
            peer = float((rank - 1) % 2)
            assert got == [peer] * 3, f"{case}: rank {rank} received {got}"
            want = [("send", True), ("recv", True)]
            assert sorted(booked) == sorted(want), f"{case}: rank {rank} booked {booked}"
