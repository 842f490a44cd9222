"""Tensor parallelism through the engine trains like one process.

The table: each layout trains the example GPT (vocabulary 13, divisible by neither 2 nor 4, so
the vocabulary padding is exercised) for a few steps on the same global batches as a plain
one-process PyTorch loop, with clipping engaged (the norm must count replicated norm weights
once), activation checkpointing off, on, and on with each TP rank keeping 1/tp of the blocks'
inputs (partition_activations; not with SP, where it is refused). Compared: the loss of every
step, the gradient norm and the final parameters gathered by ``consolidated_state_dict()``.

Tolerance (fp32, SGD with momentum): tensor parallelism changes only the order of sums (a
matmul's inner sum split in tp partial sums then all-reduced; the softmax denominator of the
vocabulary-parallel cross-entropy summed per slice), so each step differs by rounding: measured
losses within 1e-6 relative, parameters within 1e-6 after 4 steps. Bounds: 1e-5 relative on
losses and norms, 1e-5 absolute on parameters, ten times the largest measured difference; a
wrong layout (a missing all-reduce, a norm weight counted twice) is off by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from models import make_gpt, make_tokens, rank_slice
from one_process import global_batches, reference_run

import shardwise
from shardwise.verify import VerifySetup

STEPS, MB, LR, CLIP = 4, 2, 0.05, 0.3


def setup(dp: int, gas: int) -> VerifySetup:
    """The run a layout makes, for the one-process reference: the global batch of MB*dp*gas
    windows per step, SGD with momentum, clipping at CLIP."""
    config = {
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "gradient_clipping": CLIP,
    }
    return VerifySetup(make_gpt, global_batches(make_tokens, MB * dp * gas, STEPS), config)


def run_layout(tp: int, gas: int, extra: dict) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "tensor_parallel": {"size": tp, **extra.pop("tensor_parallel", {})},
        **extra,
    }
    engine, *_ = shardwise.initialize(model=make_gpt(), config=config)
    dp, rank = engine.dp_world_size, engine.dp_rank
    x, y = make_tokens(MB * dp * gas * STEPS)
    losses, norms = [], []
    for k in range(STEPS):
        total = 0.0
        for j in range(gas):
            rows = rank_slice(k, j, rank, MB, dp, gas)
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        t = torch.tensor(total)
        shardwise.comm.all_reduce(t, group=engine.mesh.dp_group)
        losses.append(t.item() / dp)
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "params": engine.consolidated_state_dict()}


CKPT = {
    "off": {},
    "on": {"activation_checkpointing": {"checkpoint_layers": ["blocks.*"]}},
    # Each TP rank keeps 1/tp of every block input (test_partition_activations.py).
    "partitioned": {
        "activation_checkpointing": {
            "checkpoint_layers": ["blocks.*"],
            "partition_activations": True,
        }
    },
}
LAYOUTS = [
    # name, world, tp, gas, extra config
    ("TP2", 2, 2, 1, {}),
    ("TP4", 4, 4, 1, {}),
    ("DP2xTP2 gas2", 4, 2, 2, {}),
    ("DP2xTP2 ZeRO-1", 4, 2, 1, {"zero_optimization": {"stage": 1}}),
    ("DP2xTP2 ZeRO-2", 4, 2, 1, {"zero_optimization": {"stage": 2}}),
    ("TP2+SP", 2, 2, 1, {"tensor_parallel": {"sequence_parallel": True}}),
]


CASES = [
    (*row, ckpt)
    for row in LAYOUTS
    for ckpt in CKPT
    if not (ckpt == "partitioned" and row[0] == "TP2+SP")  # refused: test_partition_activations
]


@pytest.mark.parametrize(
    "name,world,tp,gas,extra,ckpt", CASES, ids=[f"{c[0]}-ckpt-{c[-1]}" for c in CASES]
)
def test_tensor_parallel_layout_trains_like_one_process(name, world, tp, gas, extra, ckpt):
    extra = {**extra, **CKPT[ckpt]}
    want = reference_run(setup(world // tp, gas), STEPS)
    results = run_distributed(run_layout, world, tp, gas, extra)
    layout = f"{name} ckpt={ckpt}"
    assert max(want["norms"]) > CLIP, f"{layout}: clipping never engaged; the test is void"
    for rank, got in enumerate(results):
        tag = f"layout {layout} rank {rank}"
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), tag
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), tag
        assert got["params"].keys() == want["params"].keys(), tag
        for key, w in want["params"].items():
            diff = (got["params"][key].float() - w.float()).abs().max().item()
            assert diff <= 1e-5, f"{tag}: {key} differs by {diff:.2e}"


def build_with_optimizer_instance(_unused: int) -> str:
    model = make_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # built on the unsplit layers
    config = {"train_micro_batch_size_per_gpu": MB, "tensor_parallel": {"size": 2}}
    try:
        shardwise.initialize(model=model, optimizer=opt, config=config)
    except shardwise.ConfigError as e:
        return str(e)
    return "accepted"


def test_an_optimizer_built_before_the_split_is_refused():
    # The split layers get new parameters: an optimizer holding the old ones would train only
    # the replicated layers and silently leave q, k, v, ... at their initial values.
    for rank, message in enumerate(run_distributed(build_with_optimizer_instance, 2, 0)):
        assert "tensor parallelism replaced" in message, f"rank {rank}: {message}"
        assert "callable" in message, f"rank {rank}: the fix is not named: {message}"
