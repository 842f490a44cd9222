"""``engine.load_checkpoint``: all or nothing, over any layout.

What is loaded, each step as DeepSpeed decides what it skips:

    model weights and fp32 masters       always (masters from "master/<p>", else the weights)
    optimizer states, hyper-parameters,  unless load_optimizer_states=False or load_module_only
      loss scaler
    LR scheduler                         unless load_lr_scheduler_states=False or load_module_only
    global_steps, global_samples,        unless load_module_only
      skipped_steps, micro_steps
    data loader position, random state   unless load_module_only

In two phases, and on every rank or none. **Check**: everything that can be wrong with the checkpoint is found before the
engine changes: the manifest and files (reader.py), every tensor this rank will fill (names,
global shapes, coverage: reshard.plan), the meta (counters, loss scaler, parameter groups), the
rank states (random generators, data position, scheduler, client state), and the checksum of
every byte range that will be read. **Apply**: the data position first (the loader checks a
state before changing anything), then tensors, optimizer state, scheduler, counters, and the
random state last (nothing after it draws). Between the two, the ranks exchange their
outcomes: if the check failed on any rank, it fails on all. A checkpoint missing
``meta.counters`` or with a damaged tensor therefore fails with every rank's engine exactly as
it was.

Every piece is read from whatever layout wrote it (reshard.py), and from whatever wrote the
checkpoint: shardwise, or DeepSpeed (readers.py, checkpoint/foreign/; a format without random
state or data position leaves this run's). Returns ``(load_path,
client_state)``, or ``(None, None)`` when there is no ``latest`` and no tag (with a warning
naming the checkpoints the directory does hold, as DeepSpeed returns).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardwise import comm
from shardwise.checkpoint import lock, rotation, storage
from shardwise.checkpoint.gather import all_gather_json
from shardwise.checkpoint.optim_state import check_groups, groups_from_json, optim_targets
from shardwise.checkpoint.rank_state import (
    rng_state,
    set_data_state,
    set_rng_state,
    source_rank,
)
from shardwise.checkpoint.reshard import CheckpointError, apply, check, plan
from shardwise.checkpoint.tags import LATEST_UNIVERSAL
from shardwise.training.checkpoints.held import check_unexpected, frozen_names, layout
from shardwise.training.checkpoints.readers import open_for
from shardwise.training.counters import TrainingCounters

if TYPE_CHECKING:  # annotations only
    from shardwise.checkpoint.reader import CheckpointReader
    from shardwise.training.parts import TrainParts

logger = logging.getLogger("shardwise")

COUNTERS = TrainingCounters.names()


def load_checkpoint(
    parts: TrainParts,
    load_dir: str,
    tag: str | int | None = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict | None]:
    """Load ``load_dir/<tag>`` (default: the tag named by ``load_dir/latest``) into this
    engine, whatever layout wrote it, or nothing if anything is wrong (module docstring)."""
    if tag is None:  # "load_universal": DeepSpeed's latest_universal names the tag
        universal = parts.config.checkpoint.load_universal
        tag = storage.latest_tag(load_dir, LATEST_UNIVERSAL if universal else storage.LATEST)
        if tag is None:
            _warn_nothing_to_load(load_dir)
            return None, None
    tag = str(tag)
    storage.check_tag(tag)  # an explicit tag is checked like latest's: no "../x", no paths
    storage.recover(load_dir, tag)  # a save killed while overwriting this tag
    path = os.path.join(load_dir, tag)
    options = (load_module_strict, load_optimizer_states, load_lr_scheduler_states)
    reader, failure = None, None
    try:
        reader = open_for(parts, path)  # shardwise's format, or DeepSpeed's (foreign/)
        steps, client_state = _check(parts, reader, load_module_only, *options)
    except Exception as e:  # noqa: BLE001 - every rank must reach _agree, or the others hang
        failure = e
        if reader is not None:
            reader.close()
    _agree(failure)  # every rank loads, or none does
    with reader:
        for step in steps:
            step()
    if parts.mesh.rank == 0:
        lock.warn_if_held(load_dir)  # at the start of a job, not at its first save
    return path, client_state


def _agree(failure: BaseException | None) -> None:
    """Raise on every rank if the check failed on any (each rank checks what it will read,
    so a damaged shard fails only the rank that holds it); ``failure`` is this rank's."""

    mine = "" if failure is None else f"{type(failure).__name__}: {failure}"
    if comm.is_initialized() and comm.get_world_size() > 1:
        errors = [(r, e) for r, e in enumerate(all_gather_json(mine)) if e]
    else:
        errors = [(0, mine)] if mine else []
    if failure is not None:
        raise failure
    if errors:
        rank, error = errors[0]
        raise CheckpointError(f"rank {rank} cannot load the checkpoint, so no rank does: {error}")


def _warn_nothing_to_load(load_dir: str) -> None:
    found = sorted(rotation.checkpoints(load_dir), key=lambda c: (c.step or 0, c.created))
    held = ("... " if len(found) > 5 else "") + ", ".join(c.tag for c in found[-5:])
    logger.warning(
        "no 'latest' file in %s and no tag given: nothing loaded%s; pass tag= or save with "
        "save_latest=True",
        load_dir,
        f" (it holds {len(found)} checkpoints: {held}; a save there from a fresh start "
        "is refused, since it would mix two runs)"
        if found
        else "",
    )


def _check(
    parts: TrainParts,
    reader: CheckpointReader,
    module_only: bool,
    strict: bool,
    load_optimizer: bool,
    load_scheduler: bool,
) -> tuple[list[Callable[[], None]], dict]:
    """Phase one (module docstring): raise on anything wrong; return the steps that apply the
    checkpoint, in order, and the client state."""
    lay = layout(parts)
    frozen = frozen_names(parts)
    model_targets = lay.model + lay.master_pieces()
    copies, _ = plan(reader, model_targets, strict, optional=lambda name: name in frozen)
    if strict:
        check_unexpected(parts, reader)
    shared = reader.rank_state(0)
    client = shared.get("client_state") or {}
    if not isinstance(client, dict):
        raise _bad(reader, "client_state", client, "a dict")
    if module_only:
        check(reader, copies)
        return [lambda: apply(reader, copies)], dict(client)
    meta, later = reader.meta, []
    counters = _counters(reader, meta)
    if load_optimizer and parts.optimizer is not None:
        later += _optimizer_steps(parts, reader, lay, copies)
    sched = shared.get("lr_scheduler")
    if load_scheduler and parts.lr_scheduler is not None and sched:
        if not isinstance(sched, dict):
            raise _bad(reader, "lr_scheduler", sched, "a scheduler state dict")
        later.append(lambda: _load_scheduler(parts, sched))

    later.append(lambda: parts.counters.load_state_dict(counters))
    data = shared.get("data")
    if data is not None and not isinstance(data, dict):
        raise _bad(reader, "data", data, "a data loader state dict")
    rng = reader.rank_state(source_rank(parts.mesh.rank, reader.world_size)).get("rng")
    keep_rng = rng is None and hasattr(reader, "format")  # a foreign format saves none
    if not keep_rng:
        _check_rng(reader, rng)
    check(reader, copies)  # the checksums of every byte to be read
    # The data position is global (samples consumed), so rank 0's serves every rank: it
    # always reads data (a middle pipeline stage never iterates its loader).
    steps = [
        lambda: set_data_state(parts.training_dataloader, data),
        lambda: apply(reader, copies),
        *later,
    ]
    if not keep_rng:
        steps.append(lambda: set_rng_state(rng))
    return steps, dict(client)


def _optimizer_steps(parts: TrainParts, reader: CheckpointReader, lay: Any, copies: list) -> list:
    """Check the optimizer's part (adding its copies to ``copies``); the steps that apply it
    once ``copies`` are made."""
    meta, optimizer = reader.meta, parts.optimizer
    targets, commit = optim_targets(lay, optimizer, reader)
    copies += plan(reader, targets)[0]
    groups = meta.get("param_groups")
    if groups is not None:
        check_groups(optimizer, groups)
    scaler = meta.get("loss_scaler")
    want = set(parts.scaler.state_dict())
    if not isinstance(scaler, dict) or set(scaler) != want:
        raise _bad(reader, "meta.loss_scaler", scaler, f"a dict of {sorted(want)}")
    steps = [commit]
    if groups is not None:
        steps.append(lambda: groups_from_json(optimizer, groups))
    return [*steps, lambda: parts.scaler.load_state_dict(scaler)]


def _counters(reader: CheckpointReader, meta: dict) -> dict[str, int]:
    counters = meta.get("counters")
    if not isinstance(counters, dict) or not all(
        isinstance(counters.get(k), int) for k in COUNTERS
    ):
        raise _bad(reader, "meta.counters", counters, f"integers {', '.join(COUNTERS)}")
    return {k: int(counters[k]) for k in COUNTERS}


def _check_rng(reader: CheckpointReader, rng: Any) -> None:
    """Set the saved random state and put the current one back: what fails, fails now."""
    current = rng_state()
    try:
        set_rng_state(rng)
    except Exception as e:  # noqa: BLE001 - any malformed value: reported with its place
        raise _bad(reader, "rng", rng, f"a random state ({type(e).__name__}: {e})") from e
    finally:
        set_rng_state(current)


def _bad(reader: CheckpointReader, what: str, value: object, expected: str) -> CheckpointError:
    shown = repr(value)
    shown = shown if len(shown) < 80 else shown[:77] + "..."
    return CheckpointError(
        f"{reader.path}: {what} is {shown}, expected {expected}: the checkpoint is damaged or "
        "was not written by an engine (load_module_only=True loads the weights alone); nothing "
        "was loaded"
    )


def _load_scheduler(parts: TrainParts, state: dict) -> None:
    """The schedule's position, and its current lr in the optimizer (a scheduler's
    load_state_dict does not set it; the optimizer's groups may not have been loaded)."""
    sched = parts.lr_scheduler
    sched.load_state_dict(state)
    if parts.optimizer is not None and hasattr(sched, "get_last_lr"):
        for group, lr in zip(parts.optimizer.param_groups, sched.get_last_lr(), strict=False):
            if hasattr(group["lr"], "fill_"):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
