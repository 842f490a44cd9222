"""A ``torch.distributed.checkpoint`` (DCP) directory of a checkpoint, written by torch's own
``dcp.save`` on plain state dicts (DCP as a file format: no DTensor, no device mesh).

The keys are torchtitan's, nested as ``get_state_dict`` returns them, so that torch's reader
(``dcp.load`` into ``get_state_dict(model, optimizer)``) and torchtitan load the directory:

    model       {<p>: whole tensor}                     from "model/<p>"
    optimizer   {"state": {<p>: {<key>: tensor}},         from "optim/<key>/<p>"
                 "param_groups": [{..., "params": [<p>, ...]}]}
    lr_scheduler  the scheduler's ``state_dict()``
    train_state   {"step": global steps}

Every tensor is written whole by one rank: the tensors are dealt out to the ranks by size
(largest first, to the rank with the fewest bytes so far; every rank computes the same deal),
so each rank holds and writes about 1/W of the checkpoint, and DCP's metadata records which
file holds what. The objects (groups, scheduler, train state) come from rank 0.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from shardwise.checkpoint.pieces import Piece


def deal(sizes: dict[str, int], world: int) -> dict[str, int]:
    """The rank that writes each tensor: largest first, to the least-loaded rank (ties: the
    lowest rank); the same on every rank."""
    load, out = [0] * world, {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += sizes[name]
    return out


def targets(reader: Any, rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[Piece]]:
    """{piece name: whole tensor} this rank writes, and the targets filling them from ``reader``
    (checkpoint pieces: "model/<p>", "optim/<key>/<p>"). A 16-bit run's weights are written
    as their fp32 masters: torchtitan's parameters are fp32, and nothing is lost."""
    names = set(reader.names())
    wanted = [n for n in reader.names() if n.startswith(("model/", "optim/"))]
    source = {n: f"master/{n[6:]}" if f"master/{n[6:]}" in names else n for n in wanted}
    first = {n: reader.pieces(source[n])[0] for n in wanted}
    sizes = {n: math.prod(p.global_shape) * p.dtype.itemsize for n, p in first.items()}
    mine, pieces = {}, []
    for name, owner in deal(sizes, world).items():
        if owner != rank:
            continue
        shape = tuple(first[name].global_shape)
        t = mine[name] = torch.empty(shape, dtype=first[name].dtype)
        pieces.append(Piece(source[name], shape, tuple((0, n) for n in shape), None, t))
    return mine, pieces


def state_dict(tensors: dict[str, torch.Tensor], objects: dict[str, Any] | None) -> dict[str, Any]:
    """torchtitan's nested state of this rank's tensors; ``objects`` (rank 0): the optimizer's
    ``param_groups`` (with parameter names), ``lr_scheduler`` and ``train_state``."""
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith("model/"):
            model[name[6:]] = t
        else:
            _, key, param = name.split("/", 2)
            state.setdefault(param, {})[key] = t
    out: dict[str, Any] = {"model": model, "optimizer": {"state": state}}
    if objects is not None:
        out["optimizer"]["param_groups"] = objects["param_groups"]
        out["lr_scheduler"] = objects["lr_scheduler"]
        out["train_state"] = objects["train_state"]
    return out


def write(state: dict[str, Any], path: str) -> None:
    """torch's own writer: every rank of the default group calls it with its part.

    Imported here, not with the module: torch.distributed.checkpoint pulls in DTensor, about a
    second of every process's ``import shardwise`` (-X importtime) for a format few runs write."""
    importlib.import_module("torch.distributed.checkpoint").save(state, checkpoint_id=path)
