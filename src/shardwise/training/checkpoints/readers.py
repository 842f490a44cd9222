"""The reader of a checkpoint in any format (checkpoint/foreign/detect.py), told what this
engine knows that a foreign file lacks.

DeepSpeed's ZeRO-0 optimizer files key each parameter's state by its index in the optimizer's
groups, as torch's ``Optimizer.load_state_dict`` does: the names come from this engine's
optimizer, built by the same script. When this engine's optimizer steps the parameters
themselves (no ZeRO, no pipeline), its groups give the names exactly; under ZeRO they step flat
shards, and a pipeline stage's name part of the model, so the reader assumes each group in the
model's parameter order (checked against the saved shapes; docs/checkpoint-deepspeed.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardwise.checkpoint.foreign.detect import open_checkpoint
from shardwise.training.checkpoints.held import layout

if TYPE_CHECKING:  # annotations only
    from shardwise.training.parts import TrainParts


def param_order(parts: TrainParts) -> list[list[str]] | None:
    """The parameter names of each group of the engine's optimizer, when it steps the
    parameters themselves; None otherwise (module docstring)."""
    if parts.optimizer is None or parts.mesh.topology.pp != 1:
        return None  # a pipeline stage's optimizer names part of the model only
    names = {id(p): n for n, p in parts.module.named_parameters()}
    groups = parts.optimizer.param_groups
    if not all(id(p) in names for g in groups for p in g["params"]):
        return None
    return [[names[id(p)] for p in g["params"]] for g in groups]


def full_shapes(parts: TrainParts) -> dict[str, tuple[int, ...]]:
    """Every weight's whole shape, whatever this layout splits (DeepSpeed's tensor-parallel
    slices are placed by comparing their shapes with these)."""
    return {p.name.partition("/")[2]: tuple(p.global_shape) for p in layout(parts).model}


def open_for(parts: TrainParts, path: str) -> Any:
    """The reader of tag directory ``path`` for this engine's load."""
    samples = parts.batch.train_batch_size  # DCP saves steps only
    verify, order = parts.config.checkpoint.verify, param_order(parts)
    return open_checkpoint(path, verify, order, samples, full_shapes(parts))
