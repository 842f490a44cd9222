"""Whole tensors from tensor-parallel slices: the model as one process would hold it.

A split parameter's local tensor covers ``box`` of its global tensor (see tensor/placement.py). Every
tensor-parallel rank holds a box of the same shape (the split rounds up and pads), so one
all-gather of the local tensors and one of the box corners give every rank all slices; each is
written at its corner of a padded global tensor, and the padding (indices >= the logical
shape) is cut off. A packed tensor (q|k|v, tensor/placement.py) is assembled in its packed view, where
every rank's slice is one box, and reshaped back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise import comm
from shardwise.parallel.tensor.placement import Placement, get_placement

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup


def placements_by_name(module: nn.Module) -> dict[str, Placement]:
    """The placement of every state-dict entry that is split (tied names included)."""
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        placement = get_placement(p)
        if not placement.is_whole:
            out[name] = placement
    return out


def gather_whole(
    local: torch.Tensor, placement: Placement, group: ProcessGroup | None
) -> torch.Tensor:
    """The global tensor of ``placement.global_shape`` from every rank's box of it (assembled
    in the packed view when the tensor packs parts, then reshaped)."""
    world = comm.get_world_size(group)
    local = local.detach().contiguous().view(placement.box_shape)
    corner = torch.tensor([start for start, _ in placement.box], dtype=torch.int64)
    pieces = [torch.empty_like(local) for _ in range(world)]
    corners = [torch.empty_like(corner) for _ in range(world)]
    comm.all_gather(pieces, local, group=group)
    comm.all_gather(corners, corner, group=group)
    padded = [max(c[d].item() + local.shape[d] for c in corners) for d in range(local.dim())]
    full = local.new_zeros(padded)
    for piece, c in zip(pieces, corners, strict=True):
        index = tuple(slice(int(s), int(s) + n) for s, n in zip(c, piece.shape, strict=True))
        full[index] = piece
    full = full[tuple(slice(0, n) for n in placement.view_shape)]
    return full.reshape(placement.global_shape).clone()


def consolidate_tensor_parallel(
    state: dict[str, torch.Tensor], module: nn.Module, group: ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """``state`` (a state dict of ``module`` on one TP rank) with every split entry whole."""
    placements = placements_by_name(module)
    if not placements:
        return state
    return {
        k: gather_whole(v, placements[k], group).cpu() if k in placements else v
        for k, v in state.items()
    }
