"""``spawn(fn, nprocs)``: run ``fn(rank, *args)`` on N local processes, world already set up.

In the style of ``torch.multiprocessing.spawn`` (which starts the processes here), plus what
every caller otherwise writes by hand:

- the default process group exists before ``fn`` runs; its rendezvous is a
  ``torch.distributed.FileStore`` in a fresh temporary directory, so no port is chosen and two
  jobs on one machine never collide;
- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` are set as
  torchrun sets them, so code that reads them works unchanged;
- return values come back to the parent, in rank order;
- a child's exception is re-raised in the parent as ``SpawnError`` naming the rank, with the
  child's traceback; the other children are terminated;
- one OpenMP thread per child unless ``OMP_NUM_THREADS`` is set (as torchrun does).

``fn`` must be importable by name (a module-level function): children start with the
'spawn' method, which pickles ``fn`` by reference.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.launch.env import resolve_backend, resolve_timeout, teardown_world

# What a rank's traceback says when its collective failed because another rank died.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "DistBackendError")


class SpawnError(RuntimeError):
    """A spawned rank failed; the message names the rank and carries its traceback."""


def _worker(
    rank: int,
    fn: Callable[..., Any],
    args: tuple,
    nprocs: int,
    backend: str,
    store_path: str,
    timeout: datetime.timedelta,
    results: Any,
) -> None:
    """Body of each child (``torch.multiprocessing`` passes the rank first)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
    )
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # N children x all cores each would oversubscribe the CPU
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, nprocs)
    dist.init_process_group(backend, store=store, rank=rank, world_size=nprocs, timeout=timeout)
    try:
        value = fn(rank, *args)
        results.put((rank, value))  # before teardown, so the parent never waits on a slow exit
    finally:
        teardown_world()


class SpawnedJob:
    """Handle of running children: ``join()`` waits, then returns each rank's return value."""

    def __init__(self, context: Any, results: Any, nprocs: int, tmpdir: str) -> None:
        self._context, self._results, self._nprocs, self._tmpdir = context, results, nprocs, tmpdir
        self._values: dict[int, Any] = {}

    @property
    def pids(self) -> list[int]:
        return list(self._context.pids())

    def _drain(self) -> None:
        # Read while waiting: a child blocks on put() while the pipe is full, so results must
        # be consumed before join can see it exit.
        while not self._results.empty():
            rank, value = self._results.get()
            self._values[rank] = value

    def join(self, timeout: float | None = None) -> list[Any]:
        """Wait for every rank; raise ``SpawnError`` (failed rank) or ``TimeoutError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                self._drain()
                try:
                    if self._context.join(timeout=0.1):
                        break
                except mp.ProcessRaisedException as e:
                    rank, msg = self._root_cause(e.error_index, e.msg)
                    raise SpawnError(f"rank {rank} of {self._nprocs} failed:\n{msg}") from None
                except mp.ProcessExitedException as e:
                    raise SpawnError(
                        f"rank {e.error_index} of {self._nprocs} exited with code {e.exit_code}"
                        + (f" (signal {e.signal_name})" if e.signal_name else "")
                    ) from None
                if deadline is not None and time.monotonic() > deadline:
                    self.terminate()
                    running = sorted(set(range(self._nprocs)) - set(self._values))
                    raise TimeoutError(
                        f"spawn: ranks {running} still running after {timeout} s; terminated "
                        "(raise timeout=, or look for a rank that skipped a collective)"
                    )
            self._drain()
            missing = sorted(set(range(self._nprocs)) - set(self._values))
            if missing:
                raise SpawnError(f"ranks {missing} exited without returning a value")
            return [self._values[r] for r in range(self._nprocs)]
        finally:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _root_cause(self, rank: int, msg: str) -> tuple[int, str]:
        """The failure to report: a rank whose collective broke because a peer died reports
        a connection error, often before the peer's own exception is seen; prefer the rank
        that failed for its own reason."""
        if not any(mark in msg for mark in _PEER_LOST):
            return rank, msg
        for other, path in enumerate(self._context.error_files):
            if other == rank or not os.path.exists(path):
                continue
            with open(path, "rb") as f:
                # Written by our own child through torch.multiprocessing (a pickled traceback
                # string): the same file torch's join reads, not external data.
                other_msg = pickle.load(f)
            if isinstance(other_msg, str) and not any(m in other_msg for m in _PEER_LOST):
                return other, other_msg
        return rank, msg

    def terminate(self) -> None:
        """Stop every child still running."""
        for process in self._context.processes:
            if process.is_alive():
                process.terminate()
        for process in self._context.processes:
            process.join(5)
            if process.is_alive():
                process.kill()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    backend: str | None = None,
    join: bool = True,
    timeout: float | None = None,
) -> list[Any] | SpawnedJob:
    """Run ``fn(rank, *args)`` on ``nprocs`` local processes sharing a default process group.

    ``backend``: nccl with CUDA else gloo, or a name checked like ``init_distributed``'s.
    ``timeout`` (seconds) bounds both each collective and, with ``join``, the whole run.
    Returns the return values in rank order if ``join``, else a ``SpawnedJob`` to ``join()``.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be an integer >= 1")
    backend = resolve_backend(backend)
    pg_timeout = resolve_timeout(timeout)
    tmpdir = tempfile.mkdtemp(prefix="shardwise-spawn-")
    results = mp.get_context("spawn").SimpleQueue()
    worker_args = (
        fn,
        tuple(args),
        nprocs,
        backend,
        os.path.join(tmpdir, "store"),
        pg_timeout,
        results,
    )
    try:
        context = mp.start_processes(
            _worker, args=worker_args, nprocs=nprocs, join=False, start_method="spawn"
        )
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    job = SpawnedJob(context, results, nprocs, tmpdir)
    return job.join(timeout) if join else job
