"""Optimizer state <-> checkpoint pieces, for any layout's slots (rank_pieces.py).

Saved: every state tensor of an owner (the tensor the optimizer keys its state by) cut to each
slot's part, "optim/<key>/<param>"; a 0-dim state once per parameter. Hyper-parameters of the
parameter groups (lr, betas, weight_decay, ...) go to the checkpoint's JSON metadata.

Loaded into an optimizer whose state may still be empty (a fresh engine): the state of every
owner is rebuilt with the keys the checkpoint holds (zeros shaped like the owner, 0-dim tensors
of the saved dtype), filled, then installed in place of the owner's old state, so that a key
the checkpoint lacks (a run saved before its first step) starts fresh as it would have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.rank_pieces import Layout, Slot
from shardwise.checkpoint.reshard import CheckpointError

if TYPE_CHECKING:  # annotations only
    from torch.optim import Optimizer

    from shardwise.checkpoint.reader import CheckpointReader


def _name(key: str, slot: Slot) -> str:
    return f"optim/{key}/{slot.name}"


def _piece(key: str, slot: Slot, value: torch.Tensor) -> Piece:
    if value.dim() == 0:
        return Piece(_name(key, slot), (), (), None, value, slot.save and slot.first)
    if value.shape != slot.owner.shape:
        raise CheckpointError(
            f"optimizer state {key!r} of parameter {slot.name!r} has shape {tuple(value.shape)}, "
            f"neither 0-dim nor the parameter's {tuple(slot.owner.shape)}: this optimizer's "
            "state cannot be resharded (use an elementwise optimizer, or "
            "load_optimizer_states=False)"
        )
    return Piece(
        _name(key, slot),
        slot.global_shape,
        slot.box,
        slot.flat,
        slot.part(value),
        slot.save,
        packed=slot.packed,
    )


def optim_pieces(layout: Layout, optimizer: Optimizer) -> list[Piece]:
    """This rank's pieces of the optimizer state (to save)."""
    out = []
    for slot in layout.slots:
        for key, value in optimizer.state.get(slot.owner, {}).items():
            if value is None:
                continue
            if not torch.is_tensor(value):
                raise CheckpointError(
                    f"optimizer state {key!r} of parameter {slot.name!r} is a "
                    f"{type(value).__name__}; only tensors are saved"
                )
            out.append(_piece(key, slot, value.detach()))
    return out


def _saved_keys(reader: CheckpointReader) -> dict[str, torch.dtype | None]:
    """State keys in the checkpoint: the dtype of 0-dim ones, None for tensors."""
    keys: dict[str, torch.dtype | None] = {}
    for name in reader.names():
        kind, _, rest = name.partition("/")
        if kind != "optim":
            continue
        key = rest.partition("/")[0]
        if key not in keys:
            saved = reader.pieces(name)[0]
            keys[key] = saved.dtype if tuple(saved.global_shape) == () else None
    return keys


def _state_tensor(old: Any, owner: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A tensor for one state key: 0-dim of ``dtype``, or shaped like ``owner``. The current
    one is reused when it fits (the fill overwrites it; a fresh one would cost page faults on
    a state as large as the model); zeros are the fill's starting point otherwise."""
    like = torch.zeros((), dtype=dtype) if dtype is not None else owner.detach()
    fits = isinstance(old, torch.Tensor) and old.shape == like.shape and old.dtype == like.dtype
    if fits and old.device == like.device:
        return old
    return like if dtype is not None else torch.zeros_like(like)


def optim_targets(
    layout: Layout, optimizer: Optimizer, reader: CheckpointReader
) -> tuple[list[Piece], Callable[[], None]]:
    """The pieces to fill, in a new state for every owner with the checkpoint's keys, and the
    function that installs that state once filled (it also folds the per-parameter 0-dim
    values). The optimizer is not changed until then (a load checks everything first)."""
    keys = _saved_keys(reader)
    states = {}
    for owner in layout.owners():
        old = optimizer.state.get(owner) or {}
        states[owner] = {k: _state_tensor(old.get(k), owner, dt) for k, dt in keys.items()}
    targets, scalars = [], []
    for slot in layout.slots:
        state = states[slot.owner]
        for key, dt in keys.items():
            if dt is None:
                targets.append(_piece(key, slot, state[key]))
            else:
                tmp = torch.zeros((), dtype=dt)
                targets.append(Piece(_name(key, slot), (), (), None, tmp))
                scalars.append((state[key], tmp))

    def commit() -> None:
        for owner, state in states.items():
            optimizer.state.pop(owner, None)  # keys the checkpoint lacks start fresh
            optimizer.state[owner] = state
        seen: dict[int, torch.Tensor] = {}
        for dest, tmp in scalars:  # the largest of the parameters sharing one owner
            if id(dest) not in seen or tmp > seen[id(dest)]:
                seen[id(dest)] = tmp
                dest.copy_(tmp)

    return targets, commit


def groups_to_json(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Hyper-parameters of each parameter group (tensors as numbers, tuples as lists)."""
    out = []
    for g in optimizer.param_groups:
        entry = {}
        for k, v in g.items():
            if k == "params":
                continue
            if torch.is_tensor(v):
                v = v.item()
            entry[k] = list(v) if isinstance(v, tuple) else v
        out.append(entry)
    return out


def check_groups(optimizer: Optimizer, saved: Any) -> None:
    """Raise unless ``saved`` (the meta's param_groups) fits this optimizer's groups."""
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise CheckpointError(
            f"the checkpoint's param_groups is {type(saved).__name__}, not a list of objects: "
            "the manifest is damaged (load_optimizer_states=False skips it)"
        )
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups, or pass "
            "load_optimizer_states=False"
        )


def groups_from_json(optimizer: Optimizer, saved: list[dict[str, Any]]) -> None:
    """Restore the hyper-parameters, keeping each value's current type (tuple, tensor)."""
    check_groups(optimizer, saved)
    for g, entry in zip(optimizer.param_groups, saved, strict=True):
        for k, v in entry.items():
            current = g.get(k)
            if torch.is_tensor(current):
                current.fill_(v)
            elif isinstance(current, tuple):
                g[k] = tuple(v)
            else:
                g[k] = v
