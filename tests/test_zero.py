"""ZeRO stages 1 and 2 train like one process, and hold the memory the ZeRO paper says.

Reference of record: ``one_process.reference_run`` of ``equivalence.setup``, plain PyTorch on one
process over the global batch (in bf16 with an fp32 master copy kept by hand, the engine's policy).

Tolerances.
- fp32: sharding changes only where additions happen (a reduce-scatter sums the same
  per-rank gradients an all-reduce does; the optimizer is elementwise), so the DP bounds hold:
  SGD parameters within 2e-6, losses within 1e-5 relative.
- bf16: each rank's gradient is rounded to bf16 (8 bits of mantissa, relative step 2^-8 = 0.4%)
  before it is summed across ranks, where the reference rounds the sum once; the parameters
  are bf16 roundings of fp32 masters, so a master that moves by a hair can flip one bf16 ulp
  (up to 2^-8 * |w| ~ 2e-3 for our weights of |w| < 0.5). We allow 4e-3 absolute on
  parameters and 1e-2 relative on losses; a wrong layout (a missing average, a stale shard)
  is off by 10-100% (measured on this model).
"""

import pytest
import torch
from equivalence import STEPS, assert_layout_matches, assert_params_match, engine_run, setup
from harness import run_distributed
from one_process import reference_run

CLIP = 0.05

# (name, stage, dp, gas, dtype, optimizer)
LAYOUTS = [
    ("z1-dp2-fp32", 1, 2, 1, "fp32", "sgd"),
    ("z1-dp2-gas3-fp32", 1, 2, 3, "fp32", "sgd"),
    ("z1-dp4-fp32", 1, 4, 1, "fp32", "sgd"),
    ("z1-dp4-gas3-fp32", 1, 4, 3, "fp32", "sgd"),
    ("z2-dp2-fp32", 2, 2, 1, "fp32", "sgd"),
    ("z2-dp2-gas3-fp32", 2, 2, 3, "fp32", "sgd"),
    ("z2-dp4-fp32", 2, 4, 1, "fp32", "sgd"),
    ("z2-dp4-gas3-fp32", 2, 4, 3, "fp32", "sgd"),
    ("z1-dp2-bf16", 1, 2, 1, "bf16", "sgd"),
    ("z1-dp4-gas3-bf16", 1, 4, 3, "bf16", "sgd"),
    ("z2-dp2-gas3-bf16", 2, 2, 3, "bf16", "sgd"),
    ("z2-dp4-bf16", 2, 4, 1, "bf16", "sgd"),
    ("z0-dp2-bf16", 0, 2, 1, "bf16", "sgd"),
    ("z1-dp2-adamw", 1, 2, 1, "fp32", "adamw"),
    ("z2-dp4-gas3-adamw", 2, 4, 3, "fp32", "adamw"),
]


def _zero_block(stage: int) -> dict:
    # Small buckets: several per model, and parameters that straddle shard boundaries.
    return {"stage": stage, "reduce_bucket_size": 300}


@pytest.mark.parametrize(
    "name,stage,dp,gas,dtype,opt_name", LAYOUTS, ids=[row[0] for row in LAYOUTS]
)
def test_layout_trains_like_one_process(name, stage, dp, gas, dtype, opt_name):
    want = reference_run(setup(dp, gas, CLIP, opt_name, dtype), STEPS)
    extra = {"zero_optimization": _zero_block(stage)}
    if dtype == "bf16":
        extra["bf16"] = {"enabled": True}
    results = run_distributed(engine_run, dp, dp, gas, CLIP, opt_name, **extra)
    assert_layout_matches(results, want, name, opt_name, dtype, CLIP)


def _offload_run(stage: int) -> dict:
    extra = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    got = engine_run(2, 1, CLIP, "adamw", **extra)
    return got


def _placement(stage: int) -> dict:
    from models import make_model

    import shardwise

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
    }
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    from models import make_data

    x, y = make_data(2)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    s = engine.strategy
    states = [t for st in s.optimizer.state.values() for t in st.values() if t.dim() > 0]
    return {
        "state_devices": sorted({t.device.type for t in states}),
        "n_states": len(states),
        "master_devices": sorted({b.master.device.type for b in s.buckets}),
        "masters_are_copies": all(
            b.master.untyped_storage().data_ptr() != b.params_flat.untyped_storage().data_ptr()
            for b in s.buckets
        ),
        "offload_device": str(s.offload_device),
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_cpu_offload_keeps_master_and_states_on_the_offload_device(stage):
    want = reference_run(setup(2, 1, CLIP, "adamw"), STEPS)
    for rank, got in enumerate(run_distributed(_offload_run, 2, stage)):
        tag = f"offload stage {stage} rank {rank}"
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), tag
        assert_params_match(got["params"], want["params"], "adamw", tag)
    for rank, got in enumerate(run_distributed(_placement, 2, stage)):
        tag = f"offload stage {stage} rank {rank}"
        assert got["offload_device"] == "cpu", tag
        assert got["n_states"] > 0 and got["state_devices"] == ["cpu"], tag
        assert got["master_devices"] == ["cpu"], tag
        # The offload path copies even on a CPU-only machine, so the code a GPU runs is tested.
        assert got["masters_are_copies"], f"{tag}: master must be a separate offloaded copy"


def _bytes_per_step(stage: int) -> dict:
    from models import make_data, make_model

    import shardwise
    from shardwise import comm

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
    }
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    x, y = make_data(2, seed=engine.dp_rank)
    comm.reset_stats()
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    st = comm.stats()
    ops = ("all_reduce", "reduce_scatter", "all_gather")
    return {op: st.get(op, {}).get("sent_bytes", 0) for op in ops}


@pytest.mark.parametrize("n", [2, 4])
def test_stages_1_and_2_send_what_data_parallelism_sends(n):
    """ZeRO paper: reduce-scatter + all-gather = 2 (N-1)/N Psi, one all-reduce's worth. Padding
    to a multiple of N per bucket adds at most N-1 elements per bucket (checked at 2%)."""
    dp = sum(run_distributed(_bytes_per_step, n, 0)[0].values())
    for stage in (1, 2):
        got = run_distributed(_bytes_per_step, n, stage)[0]
        tag = f"stage {stage} N={n}"
        # The only all-reduce is the global norm: one fp32 scalar.
        assert got["all_reduce"] <= 2 * 4, f"{tag}: gradients must be reduce-scattered"
        assert got["reduce_scatter"] == pytest.approx(got["all_gather"], rel=1e-9), tag
        assert sum(got.values()) == pytest.approx(dp, rel=0.02), f"{tag}: {got} vs DP {dp}"
