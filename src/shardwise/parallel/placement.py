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

The local tensor's shape is always ``tuple(stop - start for start, stop in box)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ATTR = "_shardwise_placement"


@dataclass(frozen=True)
class Placement:
    global_shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    tp_replicated: bool = True

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)

    @property
    def is_whole(self) -> bool:
        return all(
            start == 0 and stop == n
            for (start, stop), n in zip(self.box, self.global_shape, strict=True)
        )

    def logical_box(self) -> tuple[tuple[int, int], ...]:
        """The box without padding: what this rank holds of the real tensor."""
        return tuple(
            (start, min(stop, n))
            for (start, stop), n in zip(self.box, self.global_shape, strict=True)
        )


def whole(tensor: torch.Tensor) -> Placement:
    """The placement of an unsplit tensor."""
    shape = tuple(tensor.shape)
    return Placement(shape, tuple((0, n) for n in shape), tp_replicated=True)


def set_placement(
    param: torch.Tensor,
    global_shape: tuple[int, ...],
    box: tuple[tuple[int, int], ...],
    tp_replicated: bool = False,
) -> None:
    """Record that ``param`` holds ``box`` of a global tensor of ``global_shape``."""
    placement = Placement(tuple(global_shape), tuple(tuple(r) for r in box), tp_replicated)
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
    size = -(-global_shape[dim] // parts)
    return tuple(
        (rank * size, (rank + 1) * size) if d == dim else (0, n) for d, n in enumerate(global_shape)
    )
