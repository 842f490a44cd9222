"""The whole model's state dict from the stages' state dicts (over the pipeline group).

Each stage holds the entries of its own layers (``"<layer index>.<name>"``) and of the tied
modules it uses (``"tied_modules.<key>.<name>"``). Every rank describes its entries in JSON
(name, dtype, shape: no pickling), the descriptions are all-gathered, then each stage
broadcasts its tensors, one flat buffer per dtype. An entry present on several stages (a tied
weight) is taken once, from the first stage that has it. Every rank ends with the same dict,
in stage order, with the names of a ``num_stages=1`` PipelineModule.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from shardwise import comm

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a stage's state description")
    return dtype


def _all_gather_bytes(data: bytes, group: ProcessGroup | None) -> list[bytes]:
    """Every rank's ``data`` (variable lengths), in group order."""
    world = comm.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    comm.all_gather(lengths, length, group=group)
    size = max(int(n.item()) for n in lengths)
    mine = torch.zeros(size, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    comm.all_gather(everyone, mine, group=group)
    return [bytes(t[: int(n.item())].tolist()) for t, n in zip(everyone, lengths, strict=True)]


def gather_stages(
    state: dict[str, torch.Tensor],
    group: ProcessGroup | None,
    stage_ranks: list[int],
    stage_id: int,
) -> dict[str, torch.Tensor]:
    """The union of every stage's ``state`` (tensors on CPU), the same on every rank."""
    entries = [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in state.items()]
    described = _all_gather_bytes(json.dumps(entries).encode(), group)
    out: dict[str, torch.Tensor] = {}
    for s, (src, blob) in enumerate(zip(stage_ranks, described, strict=True)):
        listing = json.loads(blob.decode())
        got: dict[str, torch.Tensor] = {}
        for dtype_name in sorted({d for _, d, _ in listing}):
            dtype = _dtype(dtype_name)
            wire = torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool reductions
            names = [(k, shape) for k, d, shape in listing if d == dtype_name]
            sizes = [int(torch.Size(shape).numel()) for _, shape in names]
            if s == stage_id:
                flat = torch.cat([state[k].detach().reshape(-1).to(wire).cpu() for k, _ in names])
            else:
                flat = torch.empty(sum(sizes), dtype=wire)
            comm.broadcast(flat, src=src, group=group)
            for (k, shape), piece in zip(names, flat.split(sizes), strict=True):
                got[k] = piece.view(shape).to(dtype).clone()
        for k, _, _ in listing:  # the stage's own order; a tied entry once, from its first stage
            out.setdefault(k, got[k])
    return out
