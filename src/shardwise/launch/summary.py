"""What ``shardwise run`` says before it starts and first when it fails.

Before the agent starts: the resolved command, the world it makes and where its master is,
in one line, so a wrong ``--nnodes`` or address is seen before any worker waits on it.

On failure torchrun prints every rank's record, then the first failure last ("Root Cause");
with eight ranks the one that matters sits under seven others. The headline names it first:
rank, local rank, host, and its exception's last line (from the error file the worker wrote,
launch/guard.py), or its exit code or signal when it wrote none.
"""

from __future__ import annotations

import argparse
import shlex
import socket

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def opening_line(args: argparse.Namespace, argv: list[str]) -> str:
    """``shardwise run: 2 nodes x 4 processes = world 8, master n0:29500 (node rank 1); ...``"""
    nnodes = args.nnodes or 1
    nproc = next(a.split("=", 1)[1] for a in argv if a.startswith("--nproc-per-node="))
    world = f"world {nnodes * int(nproc)}" if nproc.isdigit() else "world: one rank per device"
    if "--standalone" in argv:
        master = "master on this host (standalone: a free loopback port)"
    elif "--rdzv-backend=c10d" in argv:  # node ranks come from the rendezvous
        endpoint = next(a.split("=", 1)[1] for a in argv if a.startswith("--rdzv-endpoint="))
        master = f"c10d rendezvous at {endpoint}"
    else:
        master = f"master {args.master_addr or '127.0.0.1'}:{args.master_port or 29500}"
        master += f" (node rank {args.node_rank or 0})" if nnodes > 1 else ""
    low = getattr(args, "min_nnodes", None) or nnodes
    nodes = f"{nnodes} node{'s' if nnodes > 1 else ''}"
    if low != nnodes:  # elastic: the world is the most nodes' until some are lost
        nodes = f"{low} to {nnodes} nodes"
    procs = f"{nproc} process{'' if nproc == '1' else 'es'}"
    return f"shardwise run: {nodes} x {procs} = {world}, {master}; torchrun {shlex.join(argv)}"


def _last_line(message: object) -> str:
    """The exception line of a worker's error-file message (a string or torch's dict)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [x.strip() for x in str(message).splitlines() if x.strip()]
    return lines[-1] if lines else ""


def first_failure(error: ChildFailedError) -> str:
    """One line naming the first rank that failed, its host and why (module docstring)."""
    rank, failure = error.get_first_failure()
    where = f"rank {rank} (local rank {failure.local_rank}, host {socket.gethostname()})"
    why = _last_line(failure.message)
    if not why or why.startswith("To enable traceback"):
        why = f"exit code {failure.exitcode}, no exception recorded"
    return f"shardwise run: {where} failed first: {why}"
