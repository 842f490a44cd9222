"""A checkpoint written under one layout loads under another and training goes on as if the
layout had never changed: 3 steps under layout A, save, load under layout B, 3 more steps,
compared with 6 uninterrupted single-process steps.

Every pair keeps the global batch (8 samples: micro-batch 8 / dp), so the data order is the
same in every layout (data.py) and the loader's position, counted in global samples, carries
over. Tolerances are the equivalence tests' own for fp32 AdamW (equivalence.py): losses to
1e-5 relative; parameters 99.9% of elements within 1e-5 and none beyond a few lr steps (Adam
amplifies the rounding differences of another reduction order, design.md); bf16 pairs are
compared with the bf16 single process at the bf16 tolerances of test_zero.py. Dropout is off:
random streams are per rank, so no two layouts draw the same masks. Adding a layout or a pair
is one line (TP and PP rows are waiting below).

Also here: each rank reads only its shard (ZeRO-3 on 4 ranks reads a quarter), and tensor-
parallel boxes (placement.py) load into the whole tensor and back, without processes.
"""

from types import SimpleNamespace

import pytest
import torch
from checkpointing import config, train
from equivalence import assert_params_match
from test_checkpoint_resume import on_world

from shardwise.checkpoint.layouts import layout_of
from shardwise.checkpoint.optim_state import optim_pieces, optim_targets
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.reshard import PieceReader, fill
from shardwise.parallel.data import LocalGradients
from shardwise.parallel.placement import set_placement
from shardwise.parallel.zero import ZeroStrategy

BF16 = {"enabled": True}
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 40}  # biases whole, weights sharded
LAYOUTS = {  # name: (world size, config keys); the global batch is 8 in each
    "single": (1, {}),
    "dp2": (2, {}),
    "zero1-dp2": (2, {"zero_optimization": {"stage": 1}}),
    "zero2-dp2": (2, {"zero_optimization": {"stage": 2}}),
    "zero2-dp4": (4, {"zero_optimization": {"stage": 2}}),
    "zero3-dp2": (2, {"zero_optimization": Z3}),
    "zero3-dp4": (4, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}),
    "bf16-single": (1, {"bf16": BF16}),
    "bf16-zero2-dp2": (2, {"bf16": BF16, "zero_optimization": {"stage": 2}}),
    "bf16-zero3-dp2": (2, {"bf16": BF16, "zero_optimization": Z3}),
    # "tp2-pp2": (4, {"tensor_parallel": {"size": 2}, "pipeline": {"stages": 2}}),  (when landed)
    # "dp2-tp2-pp2": (8, {...}),
}
PAIRS = [  # (saved under, loaded under)
    ("zero3-dp4", "single"),
    ("single", "zero2-dp2"),
    ("zero1-dp2", "zero3-dp4"),
    ("dp2", "zero3-dp2"),
    ("zero2-dp4", "dp2"),
    ("zero3-dp2", "zero1-dp2"),
    ("bf16-zero2-dp2", "bf16-zero3-dp2"),
    ("bf16-zero3-dp2", "bf16-single"),
    # ("tp2-pp2", "zero2-dp4"), ("single", "dp2-tp2-pp2"),  (when TP and PP land)
]


def _config(name: str) -> dict:
    world, extra = LAYOUTS[name]
    return config(train_micro_batch_size_per_gpu=8 // world, **extra)


_UNINTERRUPTED: dict = {}


def uninterrupted(name: str) -> dict:
    """6 steps of the single-process run in the layout's precision (computed once)."""
    single = "bf16-single" if "bf16" in name else "single"
    if single not in _UNINTERRUPTED:
        _UNINTERRUPTED[single] = train(_config(single), 6)
    return _UNINTERRUPTED[single]


@pytest.mark.parametrize("saved, loaded", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_training_continues_under_another_layout(saved, loaded, tmp_path):
    path = str(tmp_path)
    before = on_world(LAYOUTS[saved][0], train, _config(saved), 3, 0.0, path)
    after = on_world(LAYOUTS[loaded][0], train, _config(loaded), 3, 0.0, None, path)
    want = uninterrupted(loaded)
    # bf16: the equivalence tests' bf16 tolerances (8 mantissa bits; test_zero.py).
    rel, atol = (1e-2, 4e-3) if "bf16" in loaded else (1e-5, 2e-6)
    for rank, r in enumerate(before):
        assert r["losses"] == pytest.approx(want["losses"][:3], rel=rel), f"{saved} rank {rank}"
    for rank, r in enumerate(after):
        tag = f"{saved} -> {loaded} rank {rank}"
        assert r["losses"] == pytest.approx(want["losses"][3:], rel=rel), tag
        assert r["global_samples"] == want["global_samples"], tag
        assert r["lr"] == pytest.approx(want["lr"]), tag
        assert_params_match(r["params"], want["params"], "adamw", tag, atol=atol)


class _CountingStorage:
    """The storage calls, counting the elements each read returns."""

    def __init__(self, storage) -> None:
        self.storage, self.elements = storage, 0

    def latest_tag(self, load_dir):
        return self.storage.latest_tag(load_dir)

    def CheckpointReader(self, path):  # noqa: N802 - the storage's name
        reader = self.storage.CheckpointReader(path)
        read = reader.read

        def counted(piece, index=None):
            out = read(piece, index)
            self.elements += out.numel()
            return out

        reader.read = counted
        return reader


def _elements_read(path: str) -> int:
    from checkpointing import STORAGE, engine_for

    from shardwise.checkpoint.engine_state import load_checkpoint

    storage = _CountingStorage(STORAGE)
    load_checkpoint(engine_for(_config("zero3-dp4"), 0.0, seed=99), path, storage=storage)
    return storage.elements


def test_each_rank_reads_only_its_shard(tmp_path):
    from checkpointing import DropMLP

    train(_config("single"), 1, save_to=str(tmp_path))
    params = list(DropMLP(0.0).parameters())
    saved = 3 * sum(p.numel() for p in params) + len(params)  # weights, 2 moments, steps
    reads = on_world(4, _elements_read, str(tmp_path))
    # Each rank: a quarter of the weights and of both moments (its shard of each of the 3
    # units is ceil(numel / 4): less than one element more per unit and tensor), and the
    # step of each parameter it touches. Loading without slicing would read all of `saved`.
    bound = saved / 4 + 3 * 3 + len(params)
    for rank, n in enumerate(reads):
        assert n <= bound, f"rank {rank} read {n} elements of {saved} (bound {bound:.0f})"
    assert sum(reads) >= saved - len(params), "together the ranks read the whole checkpoint"


# -- Tensor-parallel placements, without processes: two "TP ranks" of a weight whose 5 rows are
# split 3 + 3 (the last row of rank 1 is padding), saved and loaded against one whole model.
class _Half(torch.nn.Module):
    def __init__(self, t: int | None) -> None:
        super().__init__()
        rows = 5 if t is None else 3
        self.used = 2 if t == 1 else rows  # rank 1's last row is padding: never used
        self.fc = torch.nn.Linear(4, rows)
        self.scale = torch.nn.Parameter(torch.full((2,), 1.0 + (t or 0)))  # TP-replicated
        if t is not None:
            set_placement(self.fc.weight, (5, 4), ((3 * t, 3 * t + 3), (0, 4)))
            set_placement(self.fc.bias, (5,), ((3 * t, 3 * t + 3),))
            if t == 1:
                with torch.no_grad():
                    self.fc.weight[2:] = 0  # padding holds zeros
                    self.fc.bias[2:] = 0

    def forward(self, x):
        return (self.fc(x)[:, : self.used] ** 2).sum() * self.scale.sum()


def _trained(t, zero: bool):
    model = _Half(t)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    strategy = ZeroStrategy(opt, stage=1) if zero else LocalGradients(model.parameters())
    opt = getattr(strategy, "optimizer", opt)
    model(torch.randn(2, 4)).backward()
    strategy.after_backward(True)
    strategy.step(opt, 1.0)
    mesh = SimpleNamespace(dp_rank=0, tp_rank=t or 0)
    return model, opt, layout_of(model, opt, strategy, mesh)


@pytest.mark.parametrize("zero", [False, True], ids=["plain", "zero1"])
def test_tensor_parallel_boxes_load_into_the_whole_tensor_and_back(zero):
    halves = [_trained(t, zero) for t in (0, 1)]
    saved = []
    for _, opt, lay in halves:
        saved += [p for p in lay.model + optim_pieces(lay, opt) if p.save]
    whole, opt, lay = _trained(None, not zero)  # and across strategies
    targets, finish = optim_targets(lay, opt, PieceReader(saved))
    fill(PieceReader(saved), lay.model + targets)
    finish()
    (m0, _, _), (m1, _, _) = halves
    want = torch.cat([m0.fc.weight, m1.fc.weight[:2]])
    assert torch.equal(whole.fc.weight, want), "the weight is the two boxes without padding"
    assert torch.equal(whole.scale, m0.scale), "a TP-replicated parameter comes from TP rank 0"

    # The moments: gather the whole exp_avg from each side's pieces and compare.
    def whole_avg(pieces):
        out = Piece("optim/exp_avg/fc.weight", (5, 4), ((0, 5), (0, 4)), None, torch.zeros(5, 4))
        fill(PieceReader(pieces), [out])
        return out.tensor

    loaded = whole_avg([p for p in optim_pieces(lay, opt) if p.save])
    assert loaded.abs().sum() > 0 and torch.equal(loaded, whole_avg(saved)), "exp_avg"
    # And back: the whole model's pieces into rank 1's box; the padding row stays zero.
    back, _, lay1 = _trained(1, zero)
    with torch.no_grad():
        back.fc.weight.fill_(7.0)
    fill(PieceReader([p for p in lay.model if p.save]), lay1.model)
    assert torch.equal(back.fc.weight[:2], whole.fc.weight[3:]), "rank 1's rows"
    assert torch.equal(back.fc.weight[2:], torch.full((1, 4), 7.0)), "padding is never written"
