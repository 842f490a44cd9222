"""Where each parameter lies in DeepSpeed's flat fp32 partitions (ZeRO-1/2, bf16, ZeRO-3).

DeepSpeed's ZeRO optimizers step flat fp32 buffers, one per parameter group (ZeRO-3: per
sub-group), and save each rank's partition with no names; the model-state file records the
parameter names and shapes in flat order (``param_shapes``). This module recovers, per rank,
which elements of which parameter a partition holds, as *fragments*: elements [lo, hi) of the
row-major flattening of parameter ``name``, stored from element ``at`` of the rank's flat
partition. A fragment is a flat piece of the checkpoint format (pieces.py: box = the whole
parameter, flat = (lo, hi)), so any layout can load it.

ZeRO-1/2 and the bf16 optimizer (DeepSpeed 0.19 ``stage_1_and_2.py``, ``bf16_optimizer.py``):
one group's parameters are laid end to end, each followed by its alignment padding
(``param_alignment_paddings``; 0 unless ``parameter_alignment``), the whole padded to a multiple
of 2 x world and cut into ``world`` equal partitions of P elements; rank r holds flat elements
[r P, (r + 1) P). Parameter p starting at flat offset o_p:

    fragment of p on rank r = [max(o_p, r P), min(o_p + n_p, (r + 1) P)) - o_p, at = max(o_p, r P) - r P

ZeRO-3 (``stage3.py``; ``zero_to_fp32.py`` reads it the same way): every parameter is cut
on its own into ``world`` parts of m_p = ceil(n_p / world) elements (the last padded); rank r's
flat buffer is the concatenation over parameters of part r:

    fragment of p on rank r = [r m_p, min((r + 1) m_p, n_p)),  at = sum of m_q over q before p

Each file also records where its fragments start (``param_slice_mappings``, ZeRO-1/2 and bf16);
``check_mappings`` compares them with the arithmetic, so a file that does not follow it is
refused rather than loaded wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.checkpoint.manifest import CheckpointError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Fragment:
    """Elements [lo, hi) of parameter ``name``'s flattening, at element ``at`` of a partition."""

    name: str
    shape: Shape
    lo: int
    hi: int
    at: int


def group_numel(shapes: dict[str, Shape], paddings: list[int] | None) -> int:
    """Elements of one ZeRO-1/2 group before the final alignment padding."""
    pads = paddings or [0] * len(shapes)
    return sum(math.prod(s) for s in shapes.values()) + sum(pads)


def zero12_fragments(
    shapes: dict[str, Shape], paddings: list[int] | None, partition: int, rank: int
) -> list[Fragment]:
    """The fragments of one group's partition ``rank`` of ``partition`` elements (docstring)."""
    pads = paddings or [0] * len(shapes)
    if len(pads) != len(shapes):
        raise CheckpointError(
            f"{len(pads)} alignment paddings for {len(shapes)} parameters: the files disagree"
        )
    out, offset = [], 0
    first, last = rank * partition, (rank + 1) * partition
    for (name, shape), pad in zip(shapes.items(), pads, strict=True):
        n = math.prod(shape)
        start, stop = max(offset, first), min(offset + n, last)
        if start < stop:
            out.append(Fragment(name, shape, start - offset, stop - offset, start - first))
        offset += n + pad
    return out


def zero3_fragments(shapes: dict[str, Shape], world: int, rank: int) -> list[Fragment]:
    """The fragments of rank ``rank``'s ZeRO-3 flat buffer (concatenated sub-groups)."""
    out, at = [], 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        part = -(-n // world)
        lo, hi = min(rank * part, n), min((rank + 1) * part, n)
        if lo < hi:
            out.append(Fragment(name, shape, lo, hi, at))
        at += part
    return out


def zero3_numel(shapes: dict[str, Shape], world: int) -> int:
    """Elements of each rank's ZeRO-3 flat buffer (padding included)."""
    return sum(-(-math.prod(s) // world) for s in shapes.values())


def check_mappings(fragments: list[Fragment], mappings: dict, where: str) -> None:
    """Refuse a partition whose recorded ``param_slice_mappings`` ({name: (numel, start)})
    differ from the fragments computed for it."""
    mine = {f.name: (f.hi - f.lo, f.at) for f in fragments}
    saved = {}
    for name, address in mappings.items():
        try:
            saved[name] = (int(address.numel), int(address.start))
        except (AttributeError, TypeError, ValueError):
            raise CheckpointError(
                f"{where}: param_slice_mappings[{name!r}] is {address!r}"
            ) from None
    if saved != mine:
        odd = sorted(set(saved.items()) ^ set(mine.items()))[:3]
        raise CheckpointError(
            f"{where}: the partition's recorded parameter slices differ from DeepSpeed's flat "
            f"layout as shardwise reads it (first differences, (name, (numel, start)): {odd}); "
            "this file cannot be mapped, nothing was loaded"
        )


def locate(at: int, numel: int, lengths: list[int], where: str) -> tuple[int, int]:
    """(sub-group index, offset in it) of elements [at, at + numel) of a concatenation of
    buffers of ``lengths``; a range across two buffers is refused."""
    start = 0
    for i, n in enumerate(lengths):
        if at < start + n:
            if at + numel > start + n:
                break
            return i, at - start
        start += n
    raise CheckpointError(
        f"{where}: elements {at}..{at + numel} are not inside one of the flat buffers "
        f"(lengths {lengths}): the file does not follow DeepSpeed's ZeRO-3 layout"
    )
