"""``engine.autosave``: the config's ``checkpoint.save_dir``, ``save_interval_steps`` and
``auto_resume`` (shardwise extensions), so that a training script needs no checkpoint code to
survive restarts and preemption.

    "checkpoint": {"save_dir": "ckpts", "save_interval_steps": 100, "auto_resume": true}

* **Resume** (``initialize``, once the engine is built): ``load_checkpoint(save_dir)``, the tag
  ``latest`` names or, without ``latest``, the complete checkpoint of the highest step. That
  restores everything an exact resume needs (load.py): weights, masters, optimizer,
  scheduler, loss scale, counters, every rank's random generators and the training loader's
  position. Train ``for step in range(engine.global_steps, total)``.
* **Interval saves**: at the end of every optimizer step whose number is a multiple of
  ``save_interval_steps``, ``engine.save_checkpoint(save_dir)`` (tag ``global_step<N>``;
  ``keep_last`` rotates them).
* **Preemption** (whenever ``save_dir`` is set): SIGTERM sets a flag (launch/preempt.py); at the
  end of each step the ranks count the flags (one 4-byte all-reduce); if any rank has it, every
  rank saves that step (unless the interval save just did) and raises ``Preempted``: exit code
  75 and one line on rank 0's stderr.

The step's end is ``engine.step()`` at the accumulation boundary, after its counters moved
(so a save there equals one after ``train_batch``), or, with a pipeline, the end of
``train_batch``. Every rank reaches it at the same step, which the collectives here rely on.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Protocol

from shardwise.checkpoint import rotation, storage
from shardwise.checkpoint.async_save import AsyncSaver
from shardwise.launch.preempt import PREEMPTED_EXIT_CODE, Preempted, SignalFlag, agree, write_report

if TYPE_CHECKING:  # annotations only
    from shardwise.config.checkpoint import CheckpointConfig
    from shardwise.topology import ProcessMesh

logger = logging.getLogger("shardwise")


class Checkpointed(Protocol):
    """What ``AutoSave`` uses of the engine: its step, rank and size, its checkpoint calls."""

    global_steps: int

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def save_checkpoint(self, save_dir: str, *, async_save: bool = False) -> Any: ...

    def load_checkpoint(self, load_dir: str, tag: str | int | None = None) -> tuple: ...


class AutoSave:
    """What the engine does at the end of each step with the config's save keys (module doc)."""

    def __init__(self, options: CheckpointConfig) -> None:
        self.save_dir: str | None = options.save_dir
        self.interval: int | None = options.save_interval_steps
        self.auto_resume: bool = options.auto_resume
        self.async_save: bool = options.async_save
        self.writer: AsyncSaver | None = None  # made by the first asynchronous save
        self.sigterm = SignalFlag(on_idle=self._idle_exit) if self.save_dir is not None else None
        self.resumed_from: str | None = None  # the checkpoint auto_resume loaded
        self.loaded_from: str | None = None  # the save directory the engine last loaded from
        self._saved_step: int | None = None
        self._step, self._rank = 0, 0  # as of the last step end, for a SIGTERM outside a step

    def resume(self, engine: Checkpointed) -> str | None:
        """With ``auto_resume``: load the newest checkpoint of ``save_dir`` (module doc); its
        path, or None when there is none yet (a first start)."""
        if not self.auto_resume or self.save_dir is None:
            return None
        tag = newest_tag(self.save_dir)
        if tag is None:
            _say(engine, f"auto_resume: no checkpoint in {self.save_dir} yet, starting at step 0")
            return None
        self.resumed_from, _ = engine.load_checkpoint(self.save_dir, tag=tag)
        _say(engine, f"auto_resume: resumed from {self.resumed_from} (step {engine.global_steps})")
        return self.resumed_from

    def after_step(self, engine: Checkpointed) -> None:
        """At the end of an optimizer step: the interval save, then the preemption check."""
        if self.save_dir is None:
            return
        step = engine.global_steps
        self._step, self._rank = step, engine.global_rank
        stopping = agree(self.sigterm.received) if self.sigterm is not None else 0
        if self.sigterm is not None:
            self.sigterm.step_ended()
        due = self.interval is not None and step % self.interval == 0
        if (due or stopping) and self._saved_step != step:  # SIGTERM's save is a blocking one
            engine.save_checkpoint(self.save_dir, async_save=self.async_save and not stopping)
            self._saved_step = step
        if stopping:
            self._stop(engine, step, stopping)

    def _stop(self, engine: Checkpointed, step: int, ranks: int) -> None:
        path = os.path.join(self.save_dir, f"global_step{step}")
        _say(
            engine,
            f"SIGTERM (on {ranks} of {engine.world_size} ranks): stopped after step {step}, "
            f"saved {path}; exiting with code {PREEMPTED_EXIT_CODE} (preempted: run the same "
            "command again to resume)",
        )
        write_report(engine.global_rank, {"step": step, "checkpoint": path})
        raise Preempted(step, path)

    def step_started(self) -> None:
        """The first backward (or train_batch) of a step: a failed background save raises
        here, on every rank; the step's end will read the SIGTERM flag."""
        if self.writer is not None:
            self.writer.check()
        if self.sigterm is not None:
            self.sigterm.step_started()

    def _idle_exit(self) -> Preempted:
        """A SIGTERM no step end picked up (launch/preempt.py): exit with the code; the newest
        complete checkpoint is what a restart resumes from."""
        if self.writer is not None:
            self.writer.settle()  # the save in flight is written first: it is the newest
        newest = newest_tag(self.save_dir) if self.save_dir is not None else None
        path = os.path.join(self.save_dir, newest) if newest else "none"
        if self._rank == 0:
            print(
                f"[shardwise] SIGTERM outside a training step (after step {self._step}): "
                f"exiting with code {PREEMPTED_EXIT_CODE}; the newest checkpoint is {path}",
                file=sys.stderr,
                flush=True,
            )
        write_report(self._rank, {"step": self._step, "checkpoint": path})
        return Preempted(self._step, path)

    def writer_for(self, mesh: ProcessMesh) -> AsyncSaver:
        """The background writer of asynchronous saves, made at the first one (every rank
        saves together, so every rank makes its gloo group together)."""
        if self.writer is None:
            world = range(mesh.topology.world_size)
            self.writer = AsyncSaver(mesh.group_of(world, "checkpoint-writer", backend="gloo"))
        return self.writer

    def close(self) -> None:
        """SIGTERM does again what it did before this engine (``engine.destroy()``), after the
        save in flight is written."""
        if self.writer is not None:
            self.writer.wait()
        if self.sigterm is not None:
            self.sigterm.close()


def newest_tag(save_dir: str) -> str | None:
    """The tag ``latest`` names, else the complete checkpoint of the highest step, else None."""
    tag = storage.latest_tag(save_dir)
    if tag is not None:
        return tag
    stepped = [c for c in rotation.checkpoints(save_dir) if c.step is not None]
    if not stepped:
        return None
    newest = max(stepped, key=lambda c: (c.step, c.created))
    logger.warning("no 'latest' file in %s: auto_resume takes %s", save_dir, newest.tag)
    return newest.tag


def _say(engine: Checkpointed, line: str) -> None:
    if engine.global_rank == 0:
        print(f"[shardwise] {line}", file=sys.stderr, flush=True)
