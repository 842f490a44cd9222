"""An engine nobody holds is freed, with its strategy and its process groups.

Each strategy hooks every parameter it reduces (parallel/weak_hooks.py). Held strongly, the
hook made a cycle through the parameter that Python's collector cannot break, and every engine
ever built in a process stayed alive: its buckets, optimizer shards and process groups, each
group with gloo's threads (the test harness's ranks reached 226 threads). Here, on 2 ranks,
each layout builds an engine, trains a step, and drops it: after one collection the strategy
must be gone, and the model, still the user's, must train on without it (its hooks now do
nothing, so a plain backward leaves plain gradients).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from harness import run_distributed

LAYOUTS = {
    "dp2": {},
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3}},
}


def _build_step_drop(extra: dict) -> tuple[bool, bool]:
    import shardwise

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        **extra,
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
    strategy = weakref.ref(engine.strategy)
    del engine, _
    gc.collect()
    freed = strategy() is None
    plain = [p for p in model.parameters() if p.requires_grad]
    for p in plain:
        p.grad = None
    model(torch.randn(2, 8)).pow(2).mean().backward()  # the user's model, with no engine
    trains = all(p.grad is not None and torch.isfinite(p.grad).all() for p in plain)
    return freed, trains


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_dropped_engine_is_freed_and_its_model_trains_without_it(name):
    for rank, (freed, trains) in enumerate(run_distributed(_build_step_drop, 2, LAYOUTS[name])):
        assert freed, f"{name}: rank {rank} keeps the dropped engine's strategy alive"
        assert trains, f"{name}: rank {rank}: the model gives no gradient without its engine"
