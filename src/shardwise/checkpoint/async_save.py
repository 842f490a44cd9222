"""Asynchronous checkpoint saves: the step waits only for a copy, a thread writes the files.

A save (``engine.save_checkpoint(dir, async_save=True)`` or ``"checkpoint": {"async": true}``):

1. on the training thread, collective over the world: the previous save in flight is waited
   for (at most one in flight, as torch DCP's ``async_save``), the tag is agreed, the
   directory locked and checked (``storage.begin_save``);
2. on the training thread, this rank's pieces (and the replicas whose checksums the save
   compares) are copied into host staging buffers (one per piece, kept and reused by the next
   save, so host memory does not grow from save to save), its rank state deep-copied: the only
   blocking part after the agreement;
3. on a background thread, the same steps as a blocking save (``storage.finish_save``:
   write and fsync, gather the records, rank 0 checks replicas, writes the manifest, renames
   the directory into place and then moves ``latest``), over a gloo group of its own, so its
   collectives never queue behind the training's. ``latest`` moves only when every rank's
   file is on disk; a process killed before leaves the previous checkpoint as the newest.

The outcome is agreed by every rank (step 4 of a save), so an error of any rank surfaces on
every rank: ``check()`` raises it at the start of the next step (``engine.backward`` /
``train_batch``), naming the checkpoint and the rank and file that failed, and
``wait()`` raises it too. The thread is not a daemon: a normal exit waits for the write.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from typing import Any

import torch

from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.storage import SavePlan, finish_save

logger = logging.getLogger("shardwise")


class SaveHandle:
    """One asynchronous save: ``path`` (``<save_dir>/<tag>``), ``done()``, ``wait()``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.error: BaseException | None = None
        self.reported = False
        self._finished = threading.Event()

    def done(self) -> bool:
        """Whether the save has ended (published, or failed)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Wait for the save; its path, or its error raised (once per handle)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the save of {self.path} is still writing after {timeout} s")
        if self.error is not None and not self.reported:
            self.reported = True
            raise CheckpointError(f"asynchronous save failed: {self.error}") from self.error
        return self.path


class AsyncSaver:
    """The staging buffers and the save in flight of one engine (module docstring)."""

    def __init__(self, group: Any) -> None:
        self.group = group  # a gloo group of the whole world, for the background collectives
        self.staging: dict[tuple, torch.Tensor] = {}
        self.handle: SaveHandle | None = None
        self._thread: threading.Thread | None = None

    def staging_bytes(self) -> int:
        """Host memory the staging buffers hold (the memory breakdown counts it)."""
        return sum(t.numel() * t.element_size() for t in self.staging.values())

    def stage(self, pieces: list[Piece]) -> list[Piece]:
        """Copies of ``pieces`` whose tensors live in this saver's host buffers: the pieces this
        rank writes, and the replicas it does not write but whose checksums the save compares
        across ranks (replica_checksums.py), which must be those of this step too."""
        out = []
        for p in pieces:
            if not (p.save or p.verify_replicas):
                out.append(p)
                continue
            src = p.tensor.detach()
            key = (p.name, p.box, p.flat, tuple(src.shape), src.dtype)
            buf = self.staging.get(key)
            if buf is None:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                self.staging[key] = buf
            buf.copy_(src)
            out.append(dataclasses.replace(p, tensor=buf))
        return out

    def submit(
        self, plan: SavePlan, pieces: list[Piece], rank_state: dict, meta: dict, latest: bool
    ) -> SaveHandle:
        """Stage, then write on the background thread; the handle of the save."""
        self.wait()
        staged = self.stage(pieces)
        state, meta = copy.deepcopy(rank_state), copy.deepcopy(meta)
        handle = SaveHandle(f"{plan.save_dir}/{plan.tag}")

        def write() -> None:
            try:
                finish_save(plan, staged, state, meta, self.group, latest)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                handle.error = e
            finally:
                handle._finished.set()

        self.handle = handle
        self._thread = threading.Thread(target=write, name="shardwise-checkpoint-writer")
        self._thread.start()
        return handle

    def check(self) -> None:
        """Raise the error of a finished save not yet reported (the step's first call)."""
        if self.handle is not None and self.handle.done():
            self.handle.wait()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.handle is not None:
            self.handle.wait()

    def settle(self) -> None:
        """Wait for the save in flight without raising: an exit outside a step (a SIGTERM
        after the loop) names the newest checkpoint once it is written; no step comes to
        report an error, so it is logged."""
        try:
            self.wait()
        except CheckpointError as e:
            logger.error("%s", e)
