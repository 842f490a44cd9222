"""A checkpoint written under one layout loads under another and training goes on as if the
layout had never changed: 3 steps under layout A, save, load under layout B, 3 more steps,
compared with 6 uninterrupted single-process steps.

Every pair keeps the global batch (8 samples: micro-batch 8 / dp), so the data order is the
same in every layout (data.py) and the loader's position, counted in global samples, carries
over. Tolerances are the equivalence tests' own for fp32 AdamW (equivalence.py): losses to
1e-5 relative; parameters 99.9% of elements within 1e-5 and none beyond a few lr steps (Adam
amplifies the rounding differences of another reduction order, design.md); bf16 pairs are
compared with the bf16 single process at the bf16 tolerances of test_zero.py. Dropout is off:
random streams are per rank, so no two layouts draw the same masks. Tensor-parallel rows split
the MLP by MLP_PLAN, or the example GPT by its own plan; its vocabulary of 13 leaves a padded
row on TP rank 1, which must be neither saved as data nor required on load. Pipeline rows use
checkpointing.py's PipelineModule ("pipe"), whose single-process side is the same module in one
stage; PP x TP rows split its blocks by PIPE_PLAN. Adding a layout or a pair is one line.

Also here: each rank reads only its shard (ZeRO-3 on 4 ranks reads a quarter), and tensor-
parallel boxes (tensor/placement.py) load into the whole tensor and back, without processes.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from checkpointing import MLP_PLAN, PIPE_PLAN, config, train
from equivalence import assert_params_match
from test_checkpoint_resume import on_world

from shardwise.checkpoint.optim_state import optim_pieces, optim_targets
from shardwise.checkpoint.pieces import Piece
from shardwise.checkpoint.rank_pieces import layout_of
from shardwise.checkpoint.reshard import PieceReader, fill
from shardwise.parallel.data.reducer import LocalGradients
from shardwise.parallel.tensor.placement import set_placement
from shardwise.parallel.zero.stage12 import ZeroStrategy

BF16 = {"enabled": True}
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 40}  # biases whole, weights sharded
TP2 = {"size": 2, "plan": MLP_PLAN}
CPU = {"device": "cpu"}
PIPE_TP2, PP2 = {"size": 2, "plan": PIPE_PLAN}, {"stages": 2}
LAYOUTS = {  # name: (world size, config keys[, model]); the global batch is 8 in each
    "single": (1, {}),
    "dp2": (2, {}),
    "zero1-dp2": (2, {"zero_optimization": {"stage": 1}}),
    "zero2-dp2": (2, {"zero_optimization": {"stage": 2}}),
    "zero2-dp4": (4, {"zero_optimization": {"stage": 2}}),
    "zero3-dp2": (2, {"zero_optimization": Z3}),
    "zero3-dp4": (4, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}),
    "zero3-offload-dp2": (
        2,
        {"zero_optimization": {**Z3, "offload_param": CPU, "offload_optimizer": CPU}},
    ),
    "bf16-single": (1, {"bf16": BF16}),
    "bf16-zero2-dp2": (2, {"bf16": BF16, "zero_optimization": {"stage": 2}}),
    "bf16-zero3-dp2": (2, {"bf16": BF16, "zero_optimization": Z3}),
    "tp2": (2, {"tensor_parallel": TP2}),
    "zero1-dp2-tp2": (4, {"tensor_parallel": TP2, "zero_optimization": {"stage": 1}}),
    "zero2-dp2-tp2": (4, {"tensor_parallel": TP2, "zero_optimization": {"stage": 2}}),
    "pipe-single": (1, {}, "pipe"),  # the PipelineModule in one stage
    "pipe-pp2": (2, {"pipeline": PP2}, "pipe"),
    "pipe-pp4": (4, {"pipeline": {"stages": 4}}, "pipe"),  # stages 1 and 2 read no data
    "pipe-tp2-pp2": (4, {"pipeline": PP2, "tensor_parallel": PIPE_TP2}, "pipe"),
    "pipe-zero2-dp4": (4, {"zero_optimization": {"stage": 2}}, "pipe"),
    "pipe-zero1-dp2-tp2-pp2": (
        8,
        {"pipeline": PP2, "tensor_parallel": PIPE_TP2, "zero_optimization": {"stage": 1}},
        "pipe",
    ),
    "gpt-single": (1, {}, "gpt"),
    "gpt-tp2": (2, {"tensor_parallel": {"size": 2}}, "gpt"),  # vocabulary 13: a padded row
}
PAIRS = [  # (saved under, loaded under)
    ("zero3-dp4", "single"),
    ("single", "zero2-dp2"),
    ("zero1-dp2", "zero3-dp4"),
    ("dp2", "zero3-dp2"),
    ("zero2-dp4", "dp2"),
    ("zero3-dp2", "zero1-dp2"),
    ("zero3-offload-dp2", "zero2-dp4"),
    ("bf16-zero2-dp2", "bf16-zero3-dp2"),
    ("bf16-zero3-dp2", "bf16-single"),
    ("tp2", "single"),
    ("zero2-dp4", "zero1-dp2-tp2"),
    ("zero1-dp2-tp2", "zero2-dp2-tp2"),  # TP2 kept, ZeRO shards of TP slices re-cut
    ("gpt-tp2", "gpt-single"),
    ("pipe-pp2", "pipe-single"),
    ("pipe-single", "pipe-pp2"),
    ("pipe-tp2-pp2", "pipe-zero2-dp4"),
    ("pipe-pp4", "pipe-zero2-dp4"),  # the data position comes from a stage that reads
    ("pipe-single", "pipe-zero1-dp2-tp2-pp2"),  # 8 processes: the one such row
]


def _model(name: str) -> str:
    return LAYOUTS[name][2] if len(LAYOUTS[name]) > 2 else "mlp"


def _config(name: str) -> dict:
    world, extra = LAYOUTS[name][:2]
    model_parallel = extra.get("tensor_parallel", {}).get("size", 1)
    model_parallel *= extra.get("pipeline", {}).get("stages", 1)
    return config(train_micro_batch_size_per_gpu=8 * model_parallel // world, **extra)


_UNINTERRUPTED: dict = {}


def uninterrupted(name: str) -> dict:
    """6 steps of the single-process run of the layout's model in its precision (computed
    once)."""
    model = _model(name)
    single = "bf16-single" if "bf16" in name else "single" if model == "mlp" else f"{model}-single"
    if single not in _UNINTERRUPTED:
        _UNINTERRUPTED[single] = train(_config(single), 6, model=_model(single))
    return _UNINTERRUPTED[single]


@pytest.mark.parametrize("saved, loaded", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_training_continues_under_another_layout(saved, loaded, tmp_path):
    path, model = str(tmp_path), _model(saved)
    assert _model(loaded) == model, f"{saved} -> {loaded}: one model on both sides"
    before = on_world(LAYOUTS[saved][0], train, _config(saved), 3, 0.0, path, None, model)
    after = on_world(LAYOUTS[loaded][0], train, _config(loaded), 3, 0.0, None, path, model)
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


def _elements_read(path: str) -> int:
    """Elements this rank's load reads from the files (CheckpointReader.read counted)."""
    from checkpointing import engine_for, load

    from shardwise.checkpoint.reader import CheckpointReader

    read, count = CheckpointReader.read, [0]

    def counted(self, piece, index=None, out=None):
        got = read(self, piece, index, out)
        count[0] += got.numel()
        return got

    CheckpointReader.read = counted
    try:
        load(engine_for(_config("zero3-dp4"), 0.0, seed=99), path)
    finally:
        CheckpointReader.read = read
    return count[0]


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
    opt = strategy.optimizer or opt  # ZeRO rebuilt it over the master shards
    model(torch.randn(2, 4)).backward()
    strategy.after_backward(True)
    strategy.step(opt, 1.0)
    mesh = SimpleNamespace(dp_cp_rank=0, tp_rank=t or 0, topology=SimpleNamespace(dp_cp=1))
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


def test_data_parallel_replicas_are_written_once_by_every_rank(tmp_path):
    """Plain DP on 2 ranks: each tensor stored once, and both ranks write a fair share."""
    on_world(2, train, _config("dp2"), 1, 0.0, str(tmp_path))
    manifest = json.loads((tmp_path / "global_step1" / "manifest.json").read_text())
    tensors = manifest["tensors"].values()
    assert all(len(t["pieces"]) == 1 for t in tensors), "a replicated tensor stored twice"
    sizes = [f["size"] for f in manifest["files"].values()]
    # Greedy in model order over the MLP's weights (512, 32, 1024, 32, 128, 4 elements) puts
    # 1056 of 1732 on rank 1: 61%; the weights, both moments and the rank state alike. Saving
    # every replica from rank 0 would leave rank 1 its rank state only (a few KiB).
    assert min(sizes) > sum(sizes) / 3, f"file sizes {sizes}"
