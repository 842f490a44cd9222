"""Data parallelism trains like one process on the global batch.

Reference of record: a plain PyTorch loop (no shardwise) on one process over the whole global
batch of each step. Every layout below must give the same loss at every step and the same
final parameters.

Tolerances. fp32 data parallelism changes only the order of additions: each rank's gradient
is a sum over its rows, then the ranks are summed and divided by N (the reference sums all
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
from harness import run_distributed
from models import make_data, make_model, rank_slice

import shardwise
from shardwise import comm

STEPS = 6
MB = 4

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

OPTIMIZERS = {
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    "adamw": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
}


def _torch_optimizer(name: str, params):
    spec = OPTIMIZERS[name]["params"]
    if name == "sgd":
        return torch.optim.SGD(params, **spec)
    return torch.optim.AdamW(params, **spec)


def reference_run(dp: int, gas: int, clipping: float, opt_name: str) -> dict:
    """One process, plain PyTorch, the whole global batch of B = MB*dp*gas rows per step."""
    model = make_model()
    opt = _torch_optimizer(opt_name, model.parameters())
    batch = MB * dp * gas
    x, y = make_data(batch * STEPS)
    losses, norms = [], []
    for k in range(STEPS):
        rows = slice(k * batch, (k + 1) * batch)
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clipping or 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": model.state_dict()}


def _engine_config(gas: int, clipping: float, opt_name: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clipping,
        "optimizer": OPTIMIZERS[opt_name],
        # Several small buckets, so the overlap path (hooks launching buckets) is exercised.
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 300},
    }


def engine_run(dp: int, gas: int, clipping: float, opt_name: str) -> dict:
    """Each rank trains on its slice of every global batch through the engine."""
    engine, *_ = shardwise.initialize(
        model=make_model(), config=_engine_config(gas, clipping, opt_name)
    )
    rank = engine.dp_rank
    x, y = make_data(MB * dp * gas * STEPS)
    losses, norms = [], []
    for k in range(STEPS):
        micro = []
        for j in range(gas):
            rows = rank_slice(k, j, rank, MB, dp, gas)
            loss = F.mse_loss(engine(x[rows]), y[rows])
            engine.backward(loss)
            engine.step()
            micro.append(loss.detach())
        step_loss = torch.stack(micro).mean()
        comm.all_reduce(step_loss, group=engine.mesh.dp_group)
        losses.append(step_loss.item() / dp)
        norms.append(engine.get_global_grad_norm())
    assert engine.global_steps == STEPS, engine.global_steps
    assert engine.micro_steps == STEPS * gas, engine.micro_steps
    return {"losses": losses, "norms": norms, "params": engine.consolidated_state_dict()}


def assert_params_match(got: dict, want: dict, opt_name: str, tag: str) -> None:
    assert got.keys() == want.keys(), tag
    for name, w in want.items():
        diff = (got[name] - w).abs()
        if opt_name == "sgd":
            assert diff.max() < 2e-6, f"{tag}: {name} differs by {diff.max():.2e}"
        else:
            frac = (diff > 1e-5).float().mean()
            assert frac < 1e-3, f"{tag}: {name}: {frac:.2%} of elements differ by > 1e-5"
            assert diff.max() < 5e-3, f"{tag}: {name} differs by {diff.max():.2e}"


@pytest.mark.parametrize("name,dp,gas,clipping,opt_name", LAYOUTS, ids=[r[0] for r in LAYOUTS])
def test_layout_trains_like_one_process(name, dp, gas, clipping, opt_name):
    want = reference_run(dp, gas, clipping, opt_name)
    if dp == 1:
        results = [engine_run(1, gas, clipping, opt_name)]
    else:
        results = run_distributed(engine_run, dp, dp, gas, clipping, opt_name)
    for rank, got in enumerate(results):
        tag = f"layout {name} rank {rank}"
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6), tag
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), tag
        assert_params_match(got["params"], want["params"], opt_name, tag)
    if clipping:
        assert max(want["norms"]) > clipping, f"{name}: clipping never engaged; the test is void"


def _bytes_of_one_step(gas: int) -> dict:
    engine, *_ = shardwise.initialize(model=make_model(), config=_engine_config(gas, 0.0, "sgd"))
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
    engine, *_ = shardwise.initialize(model=make_model(), config=_engine_config(1, 0.0, "sgd"))
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
