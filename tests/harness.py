"""Multi-process test harness: persistent gloo worlds on CPU.

``run_distributed(fn, world_size, *args)`` runs ``fn(*args)`` on every rank of a world of
``world_size`` processes and returns the per-rank results. Worlds are kept alive between tests
(starting a process that imports torch costs seconds on 2 cores; one whose ranks have piled up
threads is replaced, see MAX_THREADS), each with its default process
group already set up through a FileStore (no ports to collide). ``fn`` must be a module-level
function so that it pickles by name.

A rank that raises fails the test at once with that rank's traceback; a world that does not
answer within ``timeout`` seconds is killed and the test fails naming the ranks that hung, so
a deadlock never stalls CI. A failed world is discarded; the next test gets a fresh one.
After each task the groups it made are destroyed, so no test inherits another's groups.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import traceback
from typing import Any

import torch.multiprocessing as mp
from waits import scaled

DEFAULT_TIMEOUT = float(os.environ.get("SHARDWISE_TEST_TIMEOUT", 180))


def _worker(rank: int, world_size: int, store_path: str, inbox: Any, outbox: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
    )
    import datetime

    import torch
    import torch.distributed as dist

    from shardwise.launch.interface import pin_gloo_to_loopback

    torch.set_num_threads(1)
    pin_gloo_to_loopback("gloo", world_size, world_size, "127.0.0.1")  # as init_distributed does
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=scaled(DEFAULT_TIMEOUT + 30)),
    )
    from shardwise import comm

    while True:
        task = inbox.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        comm.reset_stats()
        try:
            result = fn(*args, **kwargs)
            _drop_groups(dist)
            outbox.put((task_id, rank, True, result))
        except BaseException:  # noqa: BLE001 - the parent shows it
            outbox.put((task_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _drop_groups(dist: Any) -> None:
    """Destroy the process groups a task made (meshes, sub-groups), keeping the world's own.
    torch keeps every group until it is destroyed, and gloo work slows with the number alive:
    a fixed all-reduce and matmul loop took 0.25 s with 200 groups and 3.2 s with 1,000, so
    late tests of a full run were three times slower than alone. The barrier first: every
    rank has finished the task's collectives before any group goes."""
    from torch.distributed import distributed_c10d as c10d

    dist.barrier()
    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)


class World:
    """``world_size`` live worker processes sharing one default process group."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="shardwise-world-")
        store = os.path.join(self._dir, "store")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store, self.inboxes[r], self.outbox),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self._next = 0

    def run(self, fn: Any, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        self._next += 1
        task_id = self._next
        for box in self.inboxes:
            box.put((task_id, fn, args, kwargs))
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            try:
                tid, rank, ok, value = self.outbox.get(timeout=timeout)
            except queue.Empty:
                hung = sorted(set(range(self.world_size)) - set(results))
                raise TimeoutError(
                    f"{fn.__name__} on {self.world_size} ranks: ranks {hung} did not finish "
                    f"within {timeout:.0f}s (deadlock or a rank waiting on a collective)"
                ) from None
            if tid != task_id:
                continue
            if not ok:
                raise RuntimeError(
                    f"{fn.__name__} failed on rank {rank} of {self.world_size}:\n{value}"
                )
            results[rank] = value
        return [results[r] for r in range(self.world_size)]

    def threads(self) -> int:
        """The most threads any rank runs (0 where /proc does not tell)."""
        counts = [0]
        for p in self.procs:
            try:
                counts.append(len(os.listdir(f"/proc/{p.pid}/task")))
            except OSError:
                pass
        return max(counts)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        for p, box in zip(self.procs, self.inboxes, strict=True):
            if kill:
                p.kill()
            elif p.is_alive():
                box.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


_WORLDS: dict[int, World] = {}
# A group can outlive its task (an engine held by a cycle the collector cannot see, the bug
# parallel/weak_hooks.py fixes), and each keeps gloo's threads, whose TCP loops wake the CPU:
# before that fix, 226 threads per rank of the world of 4 halfway through a full run, its
# idle ranks at 9 % of a core each, the last third of the suite ~1.5x slower. A world past
# this many threads is replaced after its task, so that any such leak costs seconds, not that.
MAX_THREADS = 150


WORLD_RUNS: list[int] = []  # one entry per run_distributed call (tiers.py reads and clears it)


def run_distributed(
    fn: Any, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
    WORLD_RUNS.append(world_size)  # a test that runs here is in the full tier (tiers.py)
    world = _WORLDS.get(world_size)
    if world is None or not world.alive():
        world = _WORLDS[world_size] = World(world_size)
    try:
        results = world.run(fn, args, kwargs, scaled(timeout))
    except BaseException:
        world.close(kill=True)
        _WORLDS.pop(world_size, None)
        raise
    if world.threads() > MAX_THREADS:
        world.close()
        _WORLDS.pop(world_size, None)
    return results


def shutdown_worlds() -> None:
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()


def capture_logs(fn, *args):
    """``fn(*args)`` with the shardwise logger's INFO messages collected: (result, lines)."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("shardwise")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)  # not `log.level =`: that keeps the cached "INFO is off" answer
    try:
        return fn(*args), lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
