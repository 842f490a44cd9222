"""``report`` and ``load_checkpoint``: a shardwise engine inside Ray Train's worker loop.

Both are collective: every worker of the ``TorchTrainer`` calls them, in the same order (as
``ray.train.report`` itself requires). Ray keeps rank 0's metrics; the checkpoint is the
directory ``engine.save_checkpoint`` writes, so ``engine.load_checkpoint`` reads it back at any
number of workers and in any layout (checkpoint-format.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import ray.train
import torch

from shardwise import comm
from shardwise.integrations.ray import staging


class CheckpointedEngine(Protocol):
    """What this module calls on the engine ``shardwise.initialize`` returns."""

    def save_checkpoint(self, save_dir: str, *, client_state: dict | None = None) -> object: ...

    def load_checkpoint(self, load_dir: str, **options: Any) -> tuple[str | None, Any]: ...


def report(
    metrics: Mapping[str, Any],
    engine: CheckpointedEngine | None = None,
    *,
    checkpoint: bool = False,
    client_state: dict | None = None,
    staging_dir: str | None = None,
    checkpoint_dir_name: str | None = None,
) -> None:
    """``ray.train.report(metrics)`` on every worker, one-element tensors turned into numbers
    (Ray keeps rank 0's values: reduce a metric over the ranks first if it differs by rank).

    With ``checkpoint=True`` the ``engine`` is saved first (``engine.save_checkpoint``, with
    ``client_state``) into a fresh directory of ``staging_dir`` that every worker sees (default:
    the temporary directory, enough when the workers share a node; staging.py), each worker
    reports the part it wrote as a Ray ``Checkpoint`` (Ray merges them into one directory named
    ``checkpoint_dir_name``, or a name of its own), and the staged copy is deleted."""
    values = {k: _number(v) for k, v in metrics.items()}
    if not checkpoint:
        ray.train.report(values)
        return
    if engine is None:
        raise ValueError("report(checkpoint=True) needs the engine to save: report(m, engine, ...)")
    named = {"checkpoint_dir_name": checkpoint_dir_name} if checkpoint_dir_name else {}
    stage = staging.make_stage(staging_dir)
    try:
        engine.save_checkpoint(stage, client_state=client_state)
        view = staging.upload_view(stage, comm.get_rank())
        mine = ray.train.Checkpoint.from_directory(view) if view is not None else None
        ray.train.report(values, checkpoint=mine, **named)
    except BaseException:
        staging.remove_stage(stage, wait=False)  # a failure on one rank must not wait for all
        raise
    staging.remove_stage(stage)


def load_checkpoint(
    engine: CheckpointedEngine,
    resume_from: ray.train.Checkpoint | str | None = None,
    **options: Any,
) -> dict | None:
    """Load into ``engine`` the run's own latest checkpoint (``ray.train.get_checkpoint()``,
    there after Ray restarted the workers), else ``resume_from``: a checkpoint of an earlier
    run (a Ray ``Checkpoint`` or its path, handed in through ``train_loop_config``; Ray Train 2
    has no trainer-level ``resume_from_checkpoint``). Returns the saved ``client_state``, or
    None when there is nothing to load. ``options`` go to ``engine.load_checkpoint``
    (``load_optimizer_states=False``, ...). Collective. A checkpoint saved by ``report`` at
    another ``num_workers`` or in another layout loads the same: the saved slices are mapped
    onto this layout (checkpoint-format.md)."""
    checkpoint = ray.train.get_checkpoint() or resume_from
    if checkpoint is None:
        return None
    if isinstance(checkpoint, str):
        checkpoint = ray.train.Checkpoint(checkpoint)
    with checkpoint.as_directory() as path:
        loaded, client_state = engine.load_checkpoint(path, **options)
    if loaded is None:
        raise ValueError(
            f"resume_from: {checkpoint.path} holds no shardwise checkpoint (no 'latest' file); "
            "save one with shardwise.integrations.ray.report(..., checkpoint=True)"
        )
    return client_state


def _number(value: Any) -> Any:
    """A one-element tensor as a Python number (Ray shows and compares metrics by value)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value
