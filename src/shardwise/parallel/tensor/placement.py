"""Where a local parameter sits in the model's global (unsplit) tensor.

Tensor parallelism replaces a parameter by a slice of it; checkpoints, the gradient norm and
``consolidated_state_dict`` need to know which slice. Every split layer records it on its
parameters with ``set_placement``; a parameter without a record is whole and identical on every
tensor-parallel rank (norm weights, biases of row-parallel layers).

    global_shape  the logical shape of the unsplit tensor (for example (V, C) of an embedding)
    box           per dimension, the [start, stop) range of the global index space that the
                  local tensor covers, in order; ranges may run past global_shape when the
                  split padded the tensor (a vocabulary not divisible by the TP size): indices
                  >= global_shape[d] are padding, hold zeros and are never saved
    tp_replicated True when every tensor-parallel rank holds the same values (count once)
    packed        None, or (d, k): dimension d of the global tensor is k equal parts packed
                  end to end (a fused q|k|v or gate|up layer), and each rank holds the same
                  slice of every part. The box is then given in the *packed view* of the
                  global tensor, where dimension d of size k*P is split into (k, P):
                  ``view_shape``; the box is (0, k) on the part axis and a range of [0, P) on
                  the next. Reshaping the local tensor's dimension d into (k, L) gives the box.

The local tensor's shape is ``tuple(stop - start for start, stop in box)``, with the packed view's
two dimensions (d, d + 1) merged back into one when packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.parallel.flat import ceil_div

_ATTR = "_shardwise_placement"


@dataclass(frozen=True)
class Placement:
    global_shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    tp_replicated: bool = True
    packed: tuple[int, int] | None = None

    @property
    def view_shape(self) -> tuple[int, ...]:
        """The global shape the box indexes: ``global_shape``, or its packed view."""
        return packed_view(self.global_shape, self.packed)

    @property
    def box_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = self.box_shape
        if self.packed is None:
            return shape
        d = self.packed[0]
        return (*shape[:d], shape[d] * shape[d + 1], *shape[d + 2 :])

    @property
    def is_whole(self) -> bool:
        return all(
            start == 0 and stop == n
            for (start, stop), n in zip(self.box, self.view_shape, strict=True)
        )

    def logical_box(self) -> tuple[tuple[int, int], ...]:
        """The box without padding: what this rank holds of the real tensor."""
        return tuple(
            (start, min(stop, n))
            for (start, stop), n in zip(self.box, self.view_shape, strict=True)
        )


def packed_view(shape: tuple[int, ...], packed: tuple[int, int] | None) -> tuple[int, ...]:
    """``shape`` with dimension d (of k parts) split into (k, shape[d] // k); unchanged if None."""
    if packed is None:
        return tuple(shape)
    d, k = packed
    return (*shape[:d], k, shape[d] // k, *shape[d + 1 :])


def whole(tensor: torch.Tensor) -> Placement:
    """The placement of an unsplit tensor."""
    shape = tuple(tensor.shape)
    return Placement(shape, tuple((0, n) for n in shape), tp_replicated=True)


def set_placement(
    param: torch.Tensor,
    global_shape: tuple[int, ...],
    box: tuple[tuple[int, int], ...],
    tp_replicated: bool = False,
    packed: tuple[int, int] | None = None,
) -> None:
    """Record that ``param`` holds ``box`` of a global tensor of ``global_shape`` (of its packed
    view when ``packed`` is given, see the module doc)."""
    box = tuple(tuple(r) for r in box)
    placement = Placement(tuple(global_shape), box, tp_replicated, packed)
    if placement.local_shape != tuple(param.shape):
        raise ValueError(
            f"placement box {placement.box} has shape {placement.local_shape} but the local "
            f"tensor has shape {tuple(param.shape)}"
        )
    setattr(param, _ATTR, placement)


def get_placement(param: torch.Tensor) -> Placement:
    """The recorded placement, or the whole tensor when nothing was recorded."""
    placement = getattr(param, _ATTR, None)
    return placement if placement is not None else whole(param)


def split_box(
    global_shape: tuple[int, ...], dim: int, rank: int, parts: int
) -> tuple[tuple[int, int], ...]:
    """The box of part ``rank`` of ``parts`` equal parts along ``dim`` (the last parts may run
    into padding when ``global_shape[dim]`` does not divide: the size is rounded up)."""
    size = ceil_div(global_shape[dim], parts)
    return tuple(
        (rank * size, (rank + 1) * size) if d == dim else (0, n) for d, n in enumerate(global_shape)
    )


def packed_split_box(
    global_shape: tuple[int, ...], dim: int, packs: int, rank: int, parts: int
) -> tuple[tuple[int, int], ...]:
    """The packed-view box of part ``rank`` of ``parts`` of each of the ``packs`` parts packed
    along ``dim``: the same slice of every part (q_r | k_r | v_r)."""
    return split_box(packed_view(global_shape, (dim, packs)), dim + 1, rank, parts)
