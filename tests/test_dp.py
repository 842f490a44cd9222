"""Data parallelism trains like one process on the global batch.

Reference of record: a plain PyTorch loop (no shardwise) on one process over the whole global
batch of each step. Every layout below must give the same loss at every step and the same
final parameters.

Tolerances. fp32 data parallelism changes only the order of additions: each rank's gradient
is a sum over its rows, divided by N, then the ranks are summed (the reference sums all
rows at once). That reassociation costs a few ulps (~1e-7 relative) per step.
- SGD with momentum is linear in the gradient, so the error stays at that level: parameters
  within 2e-6 absolute after 6 steps.
- AdamW divides by sqrt(v): an element whose gradient nearly cancels can move by up to lr on
  noise alone (design.md, "Testing notes"), so we bound the typical element (99.9% within 1e-5)
  and the worst one by a few lr steps; a wrong layout moves most elements by about lr per step.
"""

import pytest
import torch
import torch.nn.functional as F
from equivalence import MB, STEPS, assert_params_match, engine_config, engine_run, setup
from harness import run_distributed
from models import make_data, make_model, rank_slice
from one_process import reference_run

import shardwise
from shardwise import comm

# Several small buckets, so the overlap path (hooks launching buckets) is exercised.
SMALL_BUCKETS = {"stage": 0, "reduce_bucket_size": 300}

# (name, dp, gas, clipping, optimizer)
LAYOUTS = [
    ("dp1", 1, 1, 0.0, "sgd"),
    ("dp2", 2, 1, 0.0, "sgd"),
    ("dp2-gas3", 2, 3, 0.0, "sgd"),
    ("dp2-clip", 2, 1, 0.05, "sgd"),
    ("dp4", 4, 1, 0.0, "sgd"),
    ("dp4-gas2-clip", 4, 2, 0.05, "sgd"),
    ("dp2-adamw-gas2-clip", 2, 2, 0.05, "adamw"),
    ("dp4-adamw", 4, 1, 0.0, "adamw"),
]


@pytest.mark.parametrize("name,dp,gas,clipping,opt_name", LAYOUTS, ids=[r[0] for r in LAYOUTS])
def test_layout_trains_like_one_process(name, dp, gas, clipping, opt_name):
    want = reference_run(setup(dp, gas, clipping, opt_name), STEPS)
    if dp == 1:
        results = [engine_run(1, gas, clipping, opt_name, zero_optimization=SMALL_BUCKETS)]
    else:
        results = run_distributed(
            engine_run, dp, dp, gas, clipping, opt_name, zero_optimization=SMALL_BUCKETS
        )
    for rank, got in enumerate(results):
        tag = f"layout {name} rank {rank}"
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6), tag
        if clipping:
            assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), tag
        else:  # nothing needs the norm, so it is not computed (DeepSpeed does the same)
            assert got["norms"] == [None] * len(want["norms"]), tag
        assert_params_match(got["params"], want["params"], opt_name, tag)
    if clipping:
        assert max(want["norms"]) > clipping, f"{name}: clipping never engaged; the test is void"


def _bytes_of_one_step(gas: int) -> dict:
    engine, *_ = shardwise.initialize(
        model=make_model(), config=engine_config(gas, 0.0, "sgd", zero_optimization=SMALL_BUCKETS)
    )
    dp, rank = engine.dp_world_size, engine.dp_rank
    x, y = make_data(MB * dp * gas)
    per_micro = []
    for j in range(gas):
        comm.reset_stats()
        rows = rank_slice(0, j, rank, MB, dp, gas)
        engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
        per_micro.append(comm.stats().get("all_reduce", {"calls": 0, "sent_bytes": 0}))
    grad_bytes = sum(p.numel() * 4 for p in engine.module.parameters())
    return {
        "per_micro": per_micro,
        "grad_bytes": grad_bytes,
        "buckets": len(engine.strategy.buckets),
    }


@pytest.mark.parametrize("dp,gas", [(2, 1), (4, 1), (2, 3)])
def test_step_sends_the_ring_all_reduce_volume(dp, gas):
    for rank, got in enumerate(run_distributed(_bytes_of_one_step, dp, gas)):
        tag = f"dp{dp} gas{gas} rank {rank}"
        s, n = got["grad_bytes"], dp
        assert got["buckets"] > 1, f"{tag}: the test model should span several buckets"
        for j, st in enumerate(got["per_micro"][:-1]):
            assert st["calls"] == 0, f"{tag}: micro-step {j} is not a boundary, yet communicated"
        last = got["per_micro"][-1]
        assert last["calls"] == got["buckets"], tag
        assert last["sent_bytes"] == pytest.approx(2 * (n - 1) / n * s, abs=got["buckets"]), tag


def _no_sync_then_step() -> dict:
    engine, *_ = shardwise.initialize(
        model=make_model(), config=engine_config(1, 0.0, "sgd", zero_optimization=SMALL_BUCKETS)
    )
    x, y = make_data(8, seed=engine.dp_rank)
    comm.reset_stats()
    with engine.no_sync():
        engine.backward(F.mse_loss(engine(x[:4]), y[:4]))
        try:
            engine.step()
            stepped_inside = True
        except shardwise.EngineError:
            stepped_inside = False
    sent_inside = comm.stats().get("all_reduce", {}).get("calls", 0)
    engine.backward(F.mse_loss(engine(x[4:]), y[4:]))
    engine.step()
    return {
        "inside": sent_inside,
        "stepped_inside": stepped_inside,
        "p": engine.consolidated_state_dict(),
    }


def test_no_sync_accumulates_locally_and_refuses_step():
    a, b = run_distributed(_no_sync_then_step, 2)
    for got in (a, b):
        assert got["inside"] == 0, "no_sync must not communicate"
        assert not got["stepped_inside"], "step() inside no_sync must raise"
    for k in a["p"]:
        assert torch.equal(a["p"][k], b["p"][k]), f"ranks diverged on {k} after the synced step"
