"""GPT-2's fused q|k|v under tensor parallelism: checkpoints and exports in the model's own terms
(issue 11 item 5).

GPT-2 stores its layers as ``Conv1D`` (weight A of shape (in, out), y = x A + b) and computes q,
k and v with one of them, ``c_attn``, whose 3C outputs are q | k | v end to end. Split by plain
columns, TP rank 0 would get q and half of k; ``packed_colwise`` gives every rank the same slice
of each part (q_r | k_r | v_r), which is not one box of the global tensor. Such a parameter
records its place in the *packed view* (tensor/placement.py: the out dimension 3C seen as (3, C)),
and checkpoints cut it into plain boxes (``reshard.plain_pieces``), so a checkpoint saved
under one layout loads into any other, and exports are the model's own tensors.

Each row saves after two steps in one layout, loads into another and takes a third step; the
result must equal three steps of one plain process (SGD with momentum: the optimizer state is
resharded too). Tolerance as in test_hf_models.py: fp32, only the order of sums differs
(1e-5, ten times the worst measured); a piece put in the wrong place (q and k swapped between
ranks) is off by the size of the weights (about 2e-2).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face tests need the dev extra")

from harness import run_distributed  # noqa: E402
from hf_models import make_hf_batches, make_hf_model, take  # noqa: E402
from models import rank_slice  # noqa: E402

import shardwise  # noqa: E402
from shardwise.checkpoint.pieces import Piece  # noqa: E402
from shardwise.checkpoint.reshard import PieceReader, fill, plain_pieces  # noqa: E402
from shardwise.parallel.tensor.layers import _local_packed  # noqa: E402
from shardwise.parallel.tensor.placement import packed_split_box  # noqa: E402

ROWS, LR, STEPS = 4, 0.1, 3  # ROWS: the global batch of every step, in every layout
# name: (processes, tensor-parallel size, zero stage)
LAYOUTS = {"single": (1, 1, 0), "tp2": (2, 2, 0), "zero1-tp2": (2, 2, 1), "dp2": (2, 1, 0)}
MOVES = [("tp2", "single"), ("single", "tp2"), ("zero1-tp2", "dp2"), ("dp2", "zero1-tp2")]


def _engine(layout: str) -> shardwise.Engine:
    procs, tp, stage = LAYOUTS[layout]
    config = {
        "train_micro_batch_size_per_gpu": ROWS // (procs // tp),
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "tensor_parallel": {"size": tp},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = shardwise.initialize(model=make_hf_model("gpt2"), config=config)
    return engine


def _steps(engine: shardwise.Engine, first: int, last: int, rows: int) -> list[float]:
    dp, rank = engine.dp_world_size, engine.dp_rank
    data = make_hf_batches("gpt2", rows * STEPS)
    losses = []
    for k in range(first, last):
        loss = engine(**take(data, rank_slice(k, 0, rank, rows // dp, dp, 1))).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def save_in(layout: str, path: str, rows: int) -> None:
    engine = _engine(layout)
    _steps(engine, 0, 2, rows)
    engine.save_checkpoint(path)


def resume_in(layout: str, path: str, rows: int) -> dict:
    engine = _engine(layout)
    engine.load_checkpoint(path)
    _steps(engine, 2, STEPS, rows)
    c_attn = engine.module.transformer.h[0].attn.c_attn
    return {"params": engine.consolidated_state_dict(), "packs": getattr(c_attn, "packs", 1)}


def reference(rows: int) -> dict:
    model = make_hf_model("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = make_hf_batches("gpt2", rows * STEPS)
    for k in range(STEPS):
        model(**take(data, slice(k * rows, (k + 1) * rows))).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("saved,loaded", MOVES, ids=[f"{a}-to-{b}" for a, b in MOVES])
def test_a_packed_qkv_checkpoint_moves_between_layouts(saved, loaded, tmp_path):
    rows = ROWS
    run_distributed(save_in, LAYOUTS[saved][0], saved, str(tmp_path), rows)
    got = run_distributed(resume_in, LAYOUTS[loaded][0], loaded, str(tmp_path), rows)
    want = reference(rows)
    for rank, result in enumerate(got):
        where = f"saved {saved}, loaded {loaded}, rank {rank}"
        if LAYOUTS[loaded][1] > 1:
            assert result["packs"] == 3, f"{where}: c_attn is not split part by part"
        for name, w in want.items():
            diff = (result["params"][name] - w).abs().max().item()
            assert diff <= 1e-5, f"{where}: {name} differs by {diff:.2e}"


@pytest.mark.parametrize("cuts", [(0, 48), (0, 20, 48), (0, 7, 25, 47, 48)])
def test_packed_pieces_cut_into_plain_boxes_rebuild_the_whole_tensor(cuts):
    """Two TP ranks' packed slices of a (8, 3*4) Conv1D weight, each held as flat ranges cut
    anywhere (a ZeRO shard may start mid-row and mid-part): the plain pieces fill the whole
    tensor exactly, element for element."""
    full = torch.arange(8 * 12, dtype=torch.float32).view(8, 12)
    pieces = []
    for rank in range(2):
        local = _local_packed(full, 1, rank, 6, 3).reshape(-1)
        box = packed_split_box((8, 12), 1, 3, rank, 2)
        for a, b in zip(cuts, cuts[1:], strict=False):
            pieces.append(Piece("model/w", (8, 12), box, (a, b), local[a:b], packed=(1, 3)))
    reader = PieceReader(plain_pieces(pieces))
    out = torch.zeros(8, 12)
    fill(reader, [Piece("model/w", (8, 12), ((0, 8), (0, 12)), None, out)])
    assert torch.equal(out, full), f"cut at {cuts}: {(out != full).sum()} elements misplaced"
