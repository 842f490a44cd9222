"""Replicas agree, or nothing is saved: a tensor held by several ranks is stored once, from one
of them, so copies that drifted apart would give a checkpoint equal to no rank's model.

The drift is the issue's: with plain data parallelism rank 1 skips one ``engine.step()`` (its
gradients are still all-reduced, it just does not apply them). Training goes on without an
error, each rank's weights now one update apart. The save must refuse naming tensors and
ranks, leaving the previous checkpoint as it was; with ``replica_check_interval`` training
itself raises within that many steps. The other direction, no false alarm in a healthy run,
is checked by every save of test_checkpoint_resume.py (16 layouts) and, for the periodic check,
by a table of layouts below.
"""

import os

import pytest
import torch.nn.functional as F
from checkpointing import MLP_PLAN, config, dataset, engine_for, save
from harness import run_distributed

from shardwise.checkpoint.manifest import CheckpointError
from shardwise.checkpoint.replica_checksums import ReplicaMismatchError
from shardwise.checkpoint.storage import CheckpointReader
from shardwise.training.checkpoints import replica_watch


def constant_lr(**extra) -> dict:
    """The tests' config without its warm-up (whose first two steps have lr 0, so that a
    skipped early step would change nothing)."""
    cfg = config(**extra)
    del cfg["scheduler"]
    return cfg


def _steps(engine, n: int, skip_on_rank1: int | None = None) -> int:
    """``n`` forward/backward/step cycles on this rank's micro-batches; rank 1 leaves out the
    step of cycle ``skip_on_rank1``. Returns the cycles completed."""
    x, y = dataset().tensors
    r = engine.global_rank
    for i in range(n):
        at = (2 * i + r) * 4 % 16
        loss = F.mse_loss(engine(x[at : at + 4]), y[at : at + 4])
        engine.backward(loss)
        if not (r == 1 and i == skip_on_rank1):
            engine.step()
    return n


def _diverge_then_save(path: str) -> dict:
    engine = engine_for(constant_lr(), 0.0, seed=0)
    _steps(engine, 1)
    save(engine, path)  # global_step1: both ranks agree
    _steps(engine, 3, skip_on_rank1=1)
    try:
        save(engine, path)
    except CheckpointError as e:
        return {"error": str(e), "steps": engine.global_steps}
    return {"error": None, "steps": engine.global_steps}


def test_a_rank_that_skipped_a_step_cannot_save(tmp_path):
    results = run_distributed(_diverge_then_save, 2, str(tmp_path))
    assert [r["steps"] for r in results] == [4, 3], "the scenario: rank 1 is one step behind"
    for rank, r in enumerate(results):
        error = r["error"]
        assert error is not None, f"rank {rank}: the save of diverged replicas succeeded"
        assert "replicas of" in error and "differ between ranks" in error, f"rank {rank}: {error}"
        assert "model/fc1.weight" in error, f"rank {rank}: the tensor is named: {error}"
        assert "ranks [0] vs ranks [1]" in error, f"rank {rank}: the ranks are named: {error}"
        assert "previous checkpoints are intact" in error, f"rank {rank}: {error}"
    visible = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))
    assert visible == ["global_step1", "latest"], f"something was written: {visible}"
    assert (tmp_path / "latest").read_text() == "global_step1"
    with CheckpointReader(str(tmp_path / "global_step1")) as r:
        r.verify_all()  # the previous checkpoint is whole


def _periodic(interval: int, skip: int | None, extra: dict, model: str = "mlp") -> dict:
    """4 cycles with ``replica_check_interval`` = ``interval``: train_batch, or with ``skip``
    hand-made cycles of which rank 1 leaves out the step of cycle ``skip``."""
    cfg = constant_lr(checkpoint={"replica_check_interval": interval}, **extra)
    engine = engine_for(cfg, 0.0, seed=0, model=model)
    calls, real = [], replica_watch.check_replicas
    replica_watch.check_replicas = lambda *a: calls.append(a[1]) or real(*a)
    done = 0
    try:
        for _ in range(4):
            if skip is None:
                engine.train_batch()
            else:
                _steps(engine, 1, skip_on_rank1=0 if done == skip else None)
            done += 1
    except ReplicaMismatchError as e:
        return {"error": str(e), "done": done, "checks": len(calls)}
    finally:
        replica_watch.check_replicas = real
    return {"error": None, "done": done, "checks": len(calls)}


def test_the_periodic_check_stops_training_within_the_interval():
    # Rank 1 skips the step of cycle 1; with interval 2 the check runs as the backward of
    # cycle 2 begins (2 reductions done): rank 0 has applied 2 steps, rank 1 one.
    results = run_distributed(_periodic, 2, 2, 1, {})
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank}: trained 4 cycles on diverged replicas"
        assert r["done"] == 2, f"rank {rank}: raised after {r['done']} cycles, not 2"
        for needle in ("model/fc1.weight", "ranks [0] vs ranks [1]", "rank 0 2, rank 1 1"):
            assert needle in r["error"], f"rank {rank}: no {needle!r} in {r['error']}"


Z3 = {"stage": 3, "stage3_param_persistence_threshold": 40}  # biases replicated, weights sharded
# name: (config keys, model, checks in 4 steps at interval 1): without a pipeline the check runs
# as the backward of steps 2, 3, 4 begins; with one, after each train_batch.
HEALTHY = {
    "dp2": ({}, "mlp", 3),
    "zero1-dp2": ({"zero_optimization": {"stage": 1}}, "mlp", 3),
    "zero2-dp2": ({"zero_optimization": {"stage": 2}}, "mlp", 3),
    "zero3-dp2": ({"zero_optimization": Z3}, "mlp", 3),
    "bf16-dp2": ({"bf16": {"enabled": True}}, "mlp", 3),
    "tp2": ({"tensor_parallel": {"size": 2, "plan": MLP_PLAN}}, "mlp", 3),  # head replicated
    "pp2": ({"pipeline": {"stages": 2}}, "pipe", 4),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_the_periodic_check_finds_nothing_in_a_healthy_run(name):
    extra, model, checks = HEALTHY[name]
    for rank, r in enumerate(run_distributed(_periodic, 2, 1, None, extra, model)):
        assert r["error"] is None, f"layout {name} rank {rank}: false alarm: {r['error']}"
        assert r["checks"] == checks, f"layout {name} rank {rank}: {r['checks']} checks ran"
