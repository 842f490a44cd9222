"""The periodic replica check of training (``"checkpoint": {"replica_check_interval": N}``).

Every rank sends the CRC-32s of every piece it holds (weights, fp32 masters, optimizer states;
checkpoint/replica_checksums.py says why replicas must agree); a mismatch raises
``ReplicaMismatchError`` on every rank. It runs at the start of the backward that reduces the
gradients of the step after each N-th (with a pipeline: after the train_batch of each N-th
step), a point that every rank reaches together even when one of them skipped a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise import comm
from shardwise.checkpoint.gather import all_gather_json
from shardwise.checkpoint.replica_checksums import ReplicaMismatchError, disagreements, records
from shardwise.training.checkpoints.held import engine_pieces

if TYPE_CHECKING:  # annotations only
    from shardwise.training.parts import TrainParts


def check_replicas(parts: TrainParts, when: str) -> None:
    """Compare every replicated piece of the model, masters and optimizer states across all
    ranks; raise ``ReplicaMismatchError`` (on every rank) if copies differ."""
    mine = records(engine_pieces(parts), only_unsaved=False)
    gathered = all_gather_json({"step": parts.counters.global_steps, "records": mine})
    problem = disagreements([g["records"] for g in gathered])
    if problem:
        steps = ", ".join(f"rank {r} {g['step']}" for r, g in enumerate(gathered))
        raise ReplicaMismatchError(f"{when} (optimizer steps taken: {steps}): {problem}")


class ReplicaWatch:
    """The periodic check (``replica_check_interval``); the engine calls the two hooks."""

    def __init__(self, interval: int | None) -> None:
        self.interval = interval
        self.reductions = 0  # backward passes that reduced gradients (equal on every rank)

    def before_backward(self, parts: TrainParts, sync: bool) -> None:
        if not sync or not self.interval:
            return
        done, self.reductions = self.reductions, self.reductions + 1
        if done and done % self.interval == 0 and _world() > 1:
            check_replicas(parts, f"replica check after {done} gradient reductions")

    def after_batch(self, parts: TrainParts) -> None:
        """With a pipeline: every rank runs each train_batch together."""
        steps = parts.counters.global_steps
        if self.interval and steps % self.interval == 0 and _world() > 1:
            check_replicas(parts, f"replica check after step {steps}")


def _world() -> int:
    return comm.get_world_size() if comm.is_initialized() else 1
