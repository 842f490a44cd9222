"""The unit a checkpoint stores: one rank's piece of one global tensor.

A layout hands the checkpoint a list of pieces; a piece says which part of which global
tensor a local tensor holds, so that any other layout can find the parts it needs:

    name          canonical name, independent of the layout:
                    "model/<param name>"        parameters and buffers, model dtype
                    "master/<param name>"       fp32 master weights (16-bit training)
                    "optim/<state key>/<param>" per-parameter optimizer state (exp_avg, ...)
                  <param name> is the name in the user's (unsplit) model.
    global_shape  the logical shape of the whole tensor
    box           [start, stop) per dimension of the global index space that the piece's
                  *box tensor* covers (tensor parallelism); may run past global_shape into
                  padding (indices >= global_shape[d]), which is never stored or required
    flat          None: ``tensor`` is the whole box tensor (shape = box shape);
                  (a, b): ``tensor`` is 1-D, elements a..b-1 of the row-major flattening of
                  the box tensor (a ZeRO shard of a possibly tensor-parallel parameter)
    tensor        the data (to save), or the destination to fill (to load)
    packed        None, or (d, k) for a tensor of k parts packed along d (tensor/placement.py): box
                  and flat are then in the packed view; ``reshard.plain_pieces`` turns such a
                  piece into plain boxes (views of its tensor) before it is saved or filled,
                  so checkpoints hold plain boxes only, whatever the layout

Replicated copies (data-parallel ranks, TP-replicated norms) are offered by one rank only:
the layout decides which (``save=True``). The others' copies are compared with it at every save
(replica_checksums.py), unless ``verify_replicas=False`` (buffers: BatchNorm's running statistics are
each rank's own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Piece:
    name: str
    global_shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    flat: tuple[int, int] | None
    tensor: torch.Tensor
    save: bool = True
    verify_replicas: bool = True
    packed: tuple[int, int] | None = None

    @property
    def box_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)
