"""The ``checkpoint`` block: DeepSpeed's checkpoint keys, plus shardwise's own: ``keep_last``,
``verify``, ``overwrite_newer``, ``replica_check_interval``, and ``save_dir``,
``save_interval_steps``, ``auto_resume`` (saving, resuming and preemption without user code:
training/checkpoints/autosave.py, launch/preempt.py; docs/reliability.md).

DeepSpeed's keys and what they mean here:

    tag_validation          "Warn" (default) / "Ignore" / "Fail", any case: what save_checkpoint
                            does when the ranks pass different tags. Used: "Fail" raises, "Warn"
                            warns, and both "Warn" and "Ignore" save under rank 0's tag (one
                            checkpoint directory; DeepSpeed's ranks would each write their own)
    load_universal          as in DeepSpeed, which file names the tag load_checkpoint loads when
                            given none: ``latest_universal`` (a universal folder, written by
                            ``ds_to_universal`` or format="deepspeed-universal") instead of
                            ``latest``. Any checkpoint loads under any layout either way
    use_node_local_storage  true is refused: rank 0 publishes the manifest after every rank has
                            written its file, so every rank must see one file system
    parallel_write          {"pipeline_stage": bool}, no effect: every rank writes its own file
                            at the same time, whatever the layout
    writer                  DeepSpeed's fast/decoupled writer engines; refused unless null
    checkpoint_serialization   torch.save's zip format; ignored (the files are safetensors)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardwise.config.errors import Notes, fail, join, show
from shardwise.config.schema import build, spec

TAG_VALIDATION_MODES = ("Warn", "Ignore", "Fail")


@dataclass(frozen=True)
class ParallelWriteConfig:
    """``"parallel_write": {"pipeline_stage": true}``: no effect (every rank writes in parallel)."""

    EXAMPLE: ClassVar[str] = '{"pipeline_stage": false}'

    pipeline_stage: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    """``"checkpoint": {"keep_last": 3}``: rotation and DeepSpeed's checkpoint keys (module doc).

    ``keep_last``: after each save, delete all but the ``keep_last`` checkpoints of the highest
    steps at or below the one just written (never one of a later step, nor the one ``latest``
    names); null keeps everything, as DeepSpeed does. ``verify``: ``load_checkpoint`` checks the
    manifest's checksum and the CRC-32 of every chunk it reads, before it changes anything
    (false: sizes and headers only, about twice as fast from the page cache).
    ``overwrite_newer``: save even into a directory that holds checkpoints of later steps than
    the run (refused otherwise, unless the engine loaded a checkpoint of that directory).
    ``replica_check_interval``: every N optimizer steps, compare the copies of every
    replicated tensor across the ranks and raise if they differ (null: only at each save).

    ``save_dir``: where the engine saves by itself: every ``save_interval_steps`` optimizer
    steps, and after the step a SIGTERM interrupts (then the process exits with code 75, see
    launch/preempt.py). ``auto_resume``: ``initialize`` loads the newest checkpoint there.
    ``async``: those saves copy the state to host buffers at the step's end and write it on a
    background thread (checkpoint/async_save.py); SIGTERM's save waits for one in flight.
    """

    EXAMPLE: ClassVar[str] = '{"keep_last": 3}'
    IGNORED_KEYS: ClassVar[dict[str, str]] = {
        "checkpoint_serialization": "torch.save's zip format; shardwise writes safetensors files",
    }

    keep_last: int | None = spec(None, ge=1)
    verify: bool = True
    overwrite_newer: bool = False
    replica_check_interval: int | None = spec(None, ge=1)
    save_dir: str | None = None
    save_interval_steps: int | None = spec(None, ge=1)
    auto_resume: bool = False
    tag_validation: str = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = field(default_factory=ParallelWriteConfig)
    writer: dict[str, Any] | None = None
    # the JSON key is "async" (a Python keyword): the periodic saves write in the background
    async_save: bool = field(default=False, metadata={"key": "async"})


def parse_checkpoint(raw: object, notes: Notes) -> CheckpointConfig:
    """Build ``CheckpointConfig``; ``tag_validation`` in any case; refuse what cannot work."""
    path = "checkpoint"
    if not isinstance(raw, dict):
        raise fail(path, f"expected an object like {CheckpointConfig.EXAMPLE}, got {show(raw)}")
    block = build(CheckpointConfig, raw, path, notes)
    mode = {m.upper(): m for m in TAG_VALIDATION_MODES}.get(block.tag_validation.upper())
    if mode is None:
        raise fail(
            join(path, "tag_validation"),
            f'expected "Warn", "Ignore" or "Fail" (any case), got {show(block.tag_validation)}',
        )
    if block.use_node_local_storage:
        raise fail(
            join(path, "use_node_local_storage"),
            "node-local checkpoint storage is not supported: rank 0 writes the manifest after "
            "every rank has written its file, so all ranks must see one file system. Remove "
            "the key or set it to false",
        )
    if block.writer is not None:
        raise fail(
            join(path, "writer"),
            "DeepSpeed's checkpoint writer engines (fast, decoupled) are not supported; "
            "shardwise writes every rank's file itself, synchronously. Remove the key",
        )
    _check_autosave(block, path)
    return dataclasses.replace(block, tag_validation=mode)


def _check_autosave(block: CheckpointConfig, path: str) -> None:
    """``save_interval_steps`` and ``auto_resume`` act on ``save_dir``: refuse them without it."""
    if block.save_dir is not None and not block.save_dir.strip():
        raise fail(join(path, "save_dir"), "is empty: give a directory, or remove the key")
    if block.save_dir is not None:
        return
    for key, value in (("save_interval_steps", None), ("auto_resume", False)):
        if getattr(block, key) != value:
            raise fail(
                join(path, key),
                f"needs checkpoint.save_dir, the directory to save into and resume from, "
                f'e.g. "checkpoint": {{"save_dir": "checkpoints", "{key}": '
                f"{show(getattr(block, key))}}}",
            )
