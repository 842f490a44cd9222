"""Fill the pieces of the current layout from the pieces a checkpoint holds, whatever its layout.

Every piece (pieces.py) is a set of global indices of one named tensor: its *box* (a TP slice,
possibly running into padding) and, for a ZeRO shard, a *flat* range [a, b) of the box's
row-major flattening. Loading is the intersection of index sets:

    for each target piece T (what this rank holds) and each saved piece S of the same name:
        J = region(T) & region(S) & [0, global_shape)       (padding is never read or required)
        T[J] <- S[J]                                         (read from the file: S's part J only)

A flat range of a box is a union of at most 2*ndim - 1 *blocks*: sub-boxes that are single
indices in the leading dimensions, a range in one dimension d, and whole in every dimension
after d, each contiguous in the flattening (``flat_blocks``). A block is a box, so every
intersection above is a box intersection. Reading J from a saved flat block reads the
contiguous range from J's first element to its last: exactly J unless the target splits a
dimension after d differently (a ZeRO checkpoint of a column-split weight loaded under another
TP size), where the range also holds the neighbours' columns of the rows in between.

Which saved tensor feeds a target (``sources``): the same name, except

    "master/<p>"          (fp32 master weights)  falls back to "model/<p>" cast to fp32, for a
                          checkpoint trained in fp32 (it has no separate masters);
    "model/<p>" in fp32   reads "master/<p>" when the checkpoint has one: the fp32 masters of a
                          16-bit run are the weights its 16-bit copy rounds.
    "<kind>/<p>"          then falls back to "<kind>/<q>" when the checkpoint records <p> as
                          an alias of <q> (meta "aliases": a tied weight stored once, such as
                          ``lm_head.weight`` of ``model.embed_tokens.weight``), since a
                          pipeline holds the tied copy on its last stage under <p>.

Errors (strict): a name the checkpoint lacks, a global shape that differs ("incompatible
model"), or an element of a target that no saved piece covers; each message names the tensor.

Loading is all-or-nothing: ``plan`` finds every error above without reading or writing
anything and returns the copies to make; ``check`` checks the checksums of every byte range
they will read (``reader.check``); ``apply`` reads. A damaged checkpoint therefore fails
before any target changes; only an I/O error in the middle of ``apply`` can leave targets
partly filled. ``fill`` is the three in a row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.sources import saved_aliases, sources  # noqa: F401 (re-exported)
from shardwise.parallel.tensor.placement import packed_view

if TYPE_CHECKING:  # annotations only
    from shardwise.checkpoint.reader import CheckpointReader

Box = tuple[tuple[int, int], ...]


@dataclass
class Region:
    """One box of global indices held by a piece; ``flat_offset`` is where the box starts in
    the piece's 1-D tensor when the piece is flat (None: the tensor is the whole box)."""

    box: Box
    flat_offset: int | None
    split_dim: int  # blocks of a flat range: whole in every dimension after this one


def flat_blocks(shape: tuple[int, ...], a: int, b: int) -> list[tuple[Box, int, int]]:
    """Elements [a, b) of the row-major flattening of ``shape`` as contiguous sub-boxes:
    ``(box in local coordinates, offset of its first element from a, split dimension)``."""
    if a >= b or math.prod(shape) == 0:
        return []
    if len(shape) <= 1:
        return [(((a, b),) if shape else (), 0, 0)]
    inner = math.prod(shape[1:])
    rest = tuple((0, n) for n in shape[1:])
    r0, r1 = a // inner, (b - 1) // inner  # first and last rows (dimension 0) touched
    if r0 == r1:
        return [
            (((r0, r0 + 1), *box), off, d + 1)
            for box, off, d in flat_blocks(shape[1:], a - r0 * inner, b - r0 * inner)
        ]
    out = []
    first_full = r0
    if a % inner:  # a partial first row
        out += [
            (((r0, r0 + 1), *box), off, d + 1)
            for box, off, d in flat_blocks(shape[1:], a % inner, inner)
        ]
        first_full = r0 + 1
    last_full = r1 + 1 if b % inner == 0 else r1
    if first_full < last_full:
        out.append((((first_full, last_full), *rest), first_full * inner - a, 0))
    if b % inner:  # a partial last row
        out += [
            (((r1, r1 + 1), *box), off + r1 * inner - a, d + 1)
            for box, off, d in flat_blocks(shape[1:], 0, b % inner)
        ]
    return out


def regions(box: Box, flat: tuple[int, int] | None) -> list[Region]:
    """The global boxes a piece with ``box`` and ``flat`` holds."""
    if flat is None:
        return [Region(tuple(box), None, 0)]
    shape = tuple(e - s for s, e in box)
    out = []
    for local, off, d in flat_blocks(shape, flat[0], flat[1]):
        glob = tuple((s + ls, s + le) for (s, _), (ls, le) in zip(box, local, strict=True))
        out.append(Region(glob, off, d))
    return out


def intersect(*boxes: Box) -> Box | None:
    """The common part of boxes, None when empty."""
    out = []
    for ranges in zip(*boxes, strict=True):
        lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def _local(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(box, origin, strict=True))


def _numel(box: Box) -> int:
    return math.prod(e - s for s, e in box)


def _view(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    """The part of a piece's tensor that holds ``region``, shaped like the region's box."""
    if region.flat_offset is None:
        return tensor
    shape = tuple(e - s for s, e in region.box)
    return tensor.view(-1)[region.flat_offset : region.flat_offset + _numel(region.box)].view(shape)


@dataclass
class Copy:
    """Elements ``part`` (a global box inside ``region``) of saved piece ``saved`` go to
    ``out`` (a view into the target, shaped like ``part``)."""

    saved: Any
    region: Region
    part: Box
    out: torch.Tensor

    def span(self) -> tuple[int, int]:
        """The elements [lo, hi) of the saved piece's stored tensor that the read touches."""
        region, part = self.region, self.part
        if not region.box:  # a scalar
            return 0, 1
        if region.flat_offset is None:  # the rows of dimension 0 that part spans
            inner = _numel(region.box[1:])
            return tuple((e - region.box[0][0]) * inner for e in part[0])
        first, last = _first_last(region, part)
        return region.flat_offset + first, region.flat_offset + last + 1

    def read(self, reader: CheckpointReader) -> None:
        """Read the elements into ``out``, straight from the file when the layouts agree (no
        intermediate copy)."""
        region, part, out, saved = self.region, self.part, self.out, self.saved
        if region.flat_offset is None:
            reader.read(saved, _local(part, region.box), out=out)
            return
        if not region.box:  # a scalar
            out.copy_(reader.read(saved, slice(0, 1)).reshape(()))
            return
        # Read the contiguous range from part's first element to its last (exactly part when
        # the layouts agree on the later dimensions), placed in the rows [j0, j1) of dim d.
        first, last = _first_last(region, part)
        span = slice(*self.span())
        if last + 1 - first == _numel(part):  # part is that range: no reshaping buffer
            if out.is_contiguous():
                reader.read(saved, span, out=out.view(-1))
            else:
                out.copy_(reader.read(saved, span).view(out.shape))
            return
        d, shape = region.split_dim, tuple(e - s for s, e in region.box)
        inner = _numel(region.box[d + 1 :])
        j0, j1 = part[d][0] - region.box[d][0], part[d][1] - region.box[d][0]
        rows = torch.empty((j1 - j0) * inner, dtype=saved.dtype)
        rows[first - j0 * inner : last + 1 - j0 * inner] = reader.read(saved, span)
        rows = rows.view((1,) * d + (j1 - j0,) + shape[d + 1 :])
        out.copy_(rows[(slice(None),) * (d + 1) + _local(part[d + 1 :], region.box[d + 1 :])])


def _first_last(region: Region, part: Box) -> tuple[int, int]:
    """Where ``part``'s first and last elements are in the row-major flattening of the box."""
    shape = tuple(e - s for s, e in region.box)
    first = _flat_index([s - o for (s, _), (o, _) in zip(part, region.box, strict=True)], shape)
    last = _flat_index([e - 1 - o for (_, e), (o, _) in zip(part, region.box, strict=True)], shape)
    return first, last


def _flat_index(index: list[int], shape: tuple[int, ...]) -> int:
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return flat


def plain_pieces(pieces: Iterable[Piece]) -> list[Piece]:
    """``pieces`` with every packed one (box and flat in the packed view, tensor/placement.py) cut into
    plain boxes of the global tensor: one per region and part, whose tensor is a view of the
    piece's (filling it fills the parameter). A packed view's region holds parts j0..j1-1 of
    width P, columns [c0, c1) of each: part j is the plain range [j P + c0, j P + c1)."""
    out = []
    for p in pieces:
        if p.packed is None:
            out.append(p)
            continue
        d = p.packed[0]
        width = packed_view(p.global_shape, p.packed)[d + 1]
        data = p.tensor if p.flat is not None else p.tensor.view(p.box_shape)
        for region in regions(p.box, p.flat):
            values = _view(data, region)
            (j0, j1), (c0, c1) = region.box[d], region.box[d + 1]
            for j in range(j0, j1):
                box = (*region.box[:d], (j * width + c0, j * width + c1), *region.box[d + 2 :])
                part = values.select(d, j - j0)
                out.append(Piece(p.name, p.global_shape, box, None, part, p.save))
    return out


def plan(
    reader: CheckpointReader,
    targets: Iterable[Piece],
    strict: bool = True,
    optional: Callable[[str], bool] | None = None,
) -> tuple[list[Copy], dict[str, str | None]]:
    """The copies that fill every target piece from the checkpoint ``reader`` holds, and per
    target name the saved name it reads (None: absent, skipped). Reads and writes nothing;
    raises every error a fill would (module docstring).

    ``optional(name)`` marks targets that may be absent from the checkpoint (left untouched).
    ``strict=False`` skips absent names and uncovered elements instead of raising."""
    names, aliases = set(reader.names()), saved_aliases(reader)
    used: dict[str, str | None] = {}
    copies: list[Copy] = []
    for target in plain_pieces(targets):
        wanted = sources(target, aliases)
        source = next((n for n in wanted if n in names), None)
        used[target.name] = source
        if source is None:
            if strict and not (optional and optional(target.name)):
                raise CheckpointError(
                    f"checkpoint has no tensor {target.name!r} (looked for "
                    f"{', '.join(map(repr, wanted))}): it was saved from another "
                    "model, or without this state (load_optimizer_states=False skips "
                    "optimizer states)"
                )
            continue
        copies += _plan_one(target, reader.pieces(source), source, strict)
    return copies, used


def check(reader: CheckpointReader, copies: list[Copy]) -> None:
    """Check the checksums of everything the copies will read (when the reader checks: a file
    reader with ``verify``), reading it once and keeping nothing."""
    check_range = getattr(reader, "check", None)
    if check_range is not None:
        for c in copies:
            check_range(c.saved, *c.span())


def apply(reader: CheckpointReader, copies: list[Copy]) -> None:
    """Make the copies (read into the targets)."""
    with torch.no_grad():
        for c in copies:
            c.read(reader)


def fill(
    reader: CheckpointReader,
    targets: Iterable[Piece],
    strict: bool = True,
    optional: Callable[[str], bool] | None = None,
) -> dict[str, str | None]:
    """Fill every target piece's tensor (in place): ``plan``, ``check``, ``apply``. Returns,
    per target name, the saved name it was read from (None: absent, skipped)."""
    copies, used = plan(reader, targets, strict, optional)
    check(reader, copies)
    apply(reader, copies)
    return used


def _plan_one(target: Piece, saved: list, source: str, strict: bool) -> list[Copy]:
    logical = tuple((0, n) for n in target.global_shape)
    for s in saved:
        if tuple(s.global_shape) != tuple(target.global_shape):
            raise CheckpointError(
                f"incompatible model: tensor {target.name!r} has global shape "
                f"{tuple(s.global_shape)} in the checkpoint ({source!r}) but "
                f"{tuple(target.global_shape)} in this model"
            )
    wanted = regions(target.box, target.flat)
    done: list[list[Box]] = [[] for _ in wanted]  # the parts read, per wanted region
    copies = []
    for s in saved:
        for sr in regions(s.box, s.flat):
            for tr, parts in zip(wanted, done, strict=True):
                part = intersect(tr.box, sr.box, logical)
                if part is None:
                    continue
                with torch.no_grad():  # a view of a parameter, written under no_grad
                    out = _view(target.tensor, tr)[_local(part, tr.box)]
                copies.append(Copy(s, sr, part, out))
                parts.append(part)
    if strict:
        _check_covered(target, wanted, done, logical, source)
    return copies


def _check_covered(
    target: Piece, wanted: list[Region], done: list[list[Box]], logical: Box, source: str
) -> None:
    for tr, parts in zip(wanted, done, strict=True):
        need = intersect(tr.box, logical)
        if need is None or need in parts:
            continue  # all padding, or one saved piece covered it all (the layouts agree)
        covered = torch.zeros(tuple(e - s for s, e in tr.box), dtype=torch.bool)
        for part in parts:
            covered[_local(part, tr.box)] = True
        hole = ~covered[_local(need, tr.box)]
        if hole.any():
            first = tuple(int(i) + s for i, (s, _) in zip(hole.nonzero()[0], need, strict=True))
            raise CheckpointError(
                f"checkpoint tensor {source!r} does not cover {target.name!r}: "
                f"{int(hole.sum())} elements of the box {need} are in no saved piece, the "
                f"first at global index {first}: the checkpoint is incomplete (a rank's "
                "file missing?)"
            )


@dataclass
class HeldPiece:
    """A piece held in memory, described like a saved one (the reader protocol's SavedPiece)."""

    name: str
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    box: Box
    flat: tuple[int, int] | None
    tensor: torch.Tensor


class PieceReader:
    """The reader protocol over pieces in memory: a state dict loaded into any layout, and the
    tests' stand-in for files. ``read`` returns copies, as a file read would."""

    def __init__(self, pieces: Iterable[Piece]) -> None:
        self._pieces: dict[str, list[HeldPiece]] = {}
        for p in pieces:
            held = HeldPiece(p.name, p.tensor.dtype, tuple(p.global_shape), p.box, p.flat, p.tensor)
            self._pieces.setdefault(p.name, []).append(held)

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], prefix: str = "model/") -> PieceReader:
        """Whole tensors named ``prefix + key``."""
        return cls(
            Piece(prefix + k, tuple(v.shape), tuple((0, n) for n in v.shape), None, v)
            for k, v in state.items()
        )

    def names(self) -> list[str]:
        return list(self._pieces)

    def pieces(self, name: str) -> list[HeldPiece]:
        return self._pieces[name]

    def read(
        self, piece: HeldPiece, index: Any = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        t = (piece.tensor if index is None else piece.tensor[index]).detach()
        if out is None:
            return t.clone()
        assert out.shape == t.shape, (tuple(out.shape), tuple(t.shape))
        return out.copy_(t)
