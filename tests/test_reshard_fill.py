"""reshard.fill: pieces of any layout filled from pieces of any other, against numpy indexing.

A "layout" here is a random TP cut of the global tensor (one dimension split in k parts, the
last ones running into padding) followed by a random ZeRO cut of every box's flattening into
contiguous ranges. Saved padding holds NaN: a NaN reaching a target means padding was read
into it.
"""

import math
import random

import numpy as np
import pytest
import torch

from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.reshard import (
    CheckpointError,
    PieceReader,
    fill,
    flat_blocks,
    intersect,
)


def _cuts(n: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    """[0, n) cut into ``parts`` contiguous ranges (some may be empty)."""
    points = sorted(rng.randint(0, n) for _ in range(parts - 1))
    edges = [0, *points, n]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _layout(shape, rng, name="model/w", values=None, dtype=torch.float64):
    """Random TP boxes (with padding) x random flat ranges; the pieces and their tensors."""
    pieces = []
    tp_dim = rng.randrange(len(shape)) if shape else None
    tp = rng.randint(1, 3) if shape else 1
    for t in range(tp):
        if tp_dim is None:
            box = ()
        else:
            size = -(-shape[tp_dim] // tp)
            box = tuple(
                (t * size, (t + 1) * size) if d == tp_dim else (0, n) for d, n in enumerate(shape)
            )
        box_shape = tuple(e - s for s, e in box)
        data = None
        if values is not None:
            data = torch.full(box_shape, float("nan"), dtype=dtype)
            logical = tuple(slice(s, min(e, n)) for (s, e), n in zip(box, shape, strict=True))
            local = tuple(slice(0, sl.stop - sl.start) for sl in logical)
            data[local] = values[logical] if shape else values
        if rng.random() < 0.3:
            tensor = data if data is not None else torch.zeros(box_shape, dtype=dtype)
            pieces.append(Piece(name, shape, box, None, tensor))
            continue
        for a, b in _cuts(math.prod(box_shape), rng.randint(1, 4), rng):
            if a == b:
                continue
            tensor = (
                data.reshape(-1)[a:b].clone()
                if data is not None
                else torch.zeros(b - a, dtype=dtype)
            )
            pieces.append(Piece(name, shape, box, (a, b), tensor.to(dtype)))
    return pieces


def _assemble(pieces, shape) -> np.ndarray:
    """The numpy reference: write every piece's logical elements into a global array."""
    out = np.full(shape, np.nan)
    for p in pieces:
        box_shape = tuple(e - s for s, e in p.box)
        full = np.full(box_shape, np.nan)
        held = np.zeros(box_shape, dtype=bool)
        if p.flat is None:
            full[...] = p.tensor.numpy()
            held[...] = True
        else:
            full.reshape(-1)[p.flat[0] : p.flat[1]] = p.tensor.numpy()
            held.reshape(-1)[p.flat[0] : p.flat[1]] = True
        idx = np.indices(box_shape).reshape(len(box_shape), -1).T if shape else [()]
        for local in idx:
            g = tuple(int(i) + s for i, (s, _) in zip(local, p.box, strict=True))
            if held[tuple(local)] and all(i < n for i, n in zip(g, shape, strict=True)):
                out[g] = full[tuple(local)]
    return out


SHAPES = [(), (7,), (5, 6), (3, 4, 5), (1, 9), (6, 1, 4)]


@pytest.mark.parametrize("seed", range(40))
def test_random_layouts_fill_from_random_layouts(seed):
    rng = random.Random(seed)
    shape = SHAPES[seed % len(SHAPES)]
    values = torch.randn(shape, dtype=torch.float64)
    saved = _layout(shape, rng, values=values)
    targets = _layout(shape, rng)
    reader = PieceReader(saved)
    fill(reader, targets)
    got = _assemble(targets, shape)
    np.testing.assert_array_equal(got, values.numpy(), err_msg=f"seed {seed} shape {shape}")
    for t in targets:  # padding stays zero: it is never read into a target
        assert not torch.isnan(t.tensor).any(), f"seed {seed}: padding reached {t.box} {t.flat}"


@pytest.mark.parametrize("shape", [(5, 6), (3, 4, 5), (11,)])
def test_flat_blocks_tile_every_range_in_order(shape):
    n = math.prod(shape)
    for a in range(n + 1):
        for b in range(a, n + 1):
            blocks = flat_blocks(shape, a, b)
            assert len(blocks) <= max(1, 2 * len(shape) - 1), (shape, a, b, blocks)
            flat = []
            for box, off, d in blocks:
                idx = np.arange(n).reshape(shape)[tuple(slice(s, e) for s, e in box)]
                assert off == len(flat), (shape, a, b, blocks)
                assert all(e - s == 1 for s, e in box[:d]), "dims before the split are single"
                assert all(box[k] == (0, shape[k]) for k in range(d + 1, len(shape)))
                flat += idx.reshape(-1).tolist()
            assert flat == list(range(a, b)), (shape, a, b, blocks)


class CountingReader(PieceReader):
    def __init__(self, pieces):
        super().__init__(pieces)
        self.elements = 0

    def read(self, piece, index=None):
        out = super().read(piece, index)
        self.elements += out.numel()
        return out


def test_whole_boxes_read_exactly_what_the_target_needs():
    values = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    saved = [
        Piece("model/w", (8, 6), ((0, 8), (3 * t, 3 * t + 3)), None, values[:, 3 * t : 3 * t + 3])
        for t in range(2)
    ]
    target = Piece("model/w", (8, 6), ((2, 4), (0, 6)), None, torch.zeros(2, 6))
    reader = CountingReader(saved)
    fill(reader, [target])
    assert torch.equal(target.tensor, values[2:4])
    assert reader.elements == 12, "read more than the 2 rows the target holds"


def test_flat_saved_pieces_read_only_the_rows_a_flat_target_overlaps():
    values = torch.randn(10, 4)
    saved = [
        Piece(
            "optim/exp_avg/w", (10, 4), ((0, 10), (0, 4)), (a, a + 10), values.view(-1)[a : a + 10]
        )
        for a in range(0, 40, 10)
    ]
    target = Piece("optim/exp_avg/w", (10, 4), ((0, 10), (0, 4)), (13, 21), torch.zeros(8))
    reader = CountingReader(saved)
    fill(reader, [target])
    assert torch.equal(target.tensor, values.view(-1)[13:21])
    assert reader.elements == 8


def test_a_name_missing_from_the_checkpoint_is_named():
    reader = PieceReader([Piece("model/a", (2,), ((0, 2),), None, torch.ones(2))])
    target = Piece("optim/exp_avg/a", (2,), ((0, 2),), None, torch.zeros(2))
    with pytest.raises(CheckpointError, match="optim/exp_avg/a"):
        fill(reader, [target])
    assert fill(reader, [target], optional=lambda n: n.startswith("optim/")) == {
        "optim/exp_avg/a": None
    }


def test_a_different_global_shape_is_an_incompatible_model():
    reader = PieceReader([Piece("model/w", (4, 8), ((0, 4), (0, 8)), None, torch.ones(4, 8))])
    target = Piece("model/w", (4, 16), ((0, 4), (0, 16)), None, torch.zeros(4, 16))
    with pytest.raises(CheckpointError, match=r"incompatible model.*model/w.*\(4, 8\).*\(4, 16\)"):
        fill(reader, [target])


def test_an_uncovered_region_is_named_with_its_first_index():
    values = torch.randn(6, 2)
    saved = [Piece("model/w", (6, 2), ((0, 6), (0, 2)), (0, 7), values.view(-1)[:7])]
    target = Piece("model/w", (6, 2), ((0, 6), (0, 2)), None, torch.zeros(6, 2))
    with pytest.raises(CheckpointError, match=r"'model/w'.*5 elements.*\(3, 1\)"):
        fill(PieceReader(saved), [target])
    fill(PieceReader(saved), [target], strict=False)  # fills what there is
    assert torch.equal(target.tensor.view(-1)[:7], values.view(-1)[:7])


def test_masters_fall_back_to_the_model_and_fp32_models_prefer_masters():
    w16 = torch.randn(3).to(torch.bfloat16)
    w32 = torch.randn(3)
    whole = ((0, 3),)
    fp32_ckpt = PieceReader([Piece("model/w", (3,), whole, None, w32)])
    bf16_ckpt = PieceReader(
        [Piece("model/w", (3,), whole, None, w16), Piece("master/w", (3,), whole, None, w32)]
    )
    master = Piece("master/w", (3,), whole, None, torch.zeros(3))
    assert fill(fp32_ckpt, [master]) == {"master/w": "model/w"}
    assert torch.equal(master.tensor, w32)
    model32 = Piece("model/w", (3,), whole, None, torch.zeros(3))
    assert fill(bf16_ckpt, [model32]) == {"model/w": "master/w"}
    assert torch.equal(model32.tensor, w32), "an fp32 model must take the fp32 masters"
    model16 = Piece("model/w", (3,), whole, None, torch.zeros(3, dtype=torch.bfloat16))
    assert fill(bf16_ckpt, [model16]) == {"model/w": "model/w"}
    assert torch.equal(model16.tensor, w16)


def test_intersect():
    assert intersect(((0, 4), (2, 6)), ((1, 9), (0, 3))) == ((1, 4), (2, 3))
    assert intersect(((0, 4),), ((4, 9),)) is None
    assert intersect((), ()) == ()
