"""ZeRO stage 3 trains like one process, holds 16 Psi / N bytes and sends 1.5x what DP sends.

Reference of record: ``one_process.reference_run`` of ``equivalence.setup`` (plain PyTorch, one
process, the global batch; in bf16 with an fp32 master copy kept by hand, the engine's policy). Final parameters
come from ``engine.consolidated_state_dict()`` (every unit all-gathered).

Tolerances (the same as stages 1-2, tests/test_zero.py, for the same reasons).
- fp32: sharding changes only where additions happen (the reduce-scatter sums the per-rank
  gradients an all-reduce would; forward and backward see the same whole weights; the
  optimizer is elementwise): SGD parameters within 2e-6, losses within 1e-5 relative. Measured:
  parameters within 3e-8 (AdamW 2e-7), losses within 3e-7.
- bf16: each rank's gradient is rounded to bf16 (relative step 2^-8) before the ranks' sum,
  where the reference rounds the sum once, and the parameters are bf16 roundings of fp32
  masters, so one bf16 ulp (2^-8 |w|, up to 4e-3 for |w| < 1) may flip: 4e-3 absolute on
  parameters, 1e-2 relative on losses. Measured: parameters within 2e-3, losses within 4e-3.
  A wrong layout (a missing 1/N, a stale or misplaced shard) is off by 10-100%.
- AdamW runs in fp32 only: with bf16 gradients Adam's m / sqrt(v) turns rounding noise into
  moves of up to 2 lr on a few elements (measured at dp4 gas3: 4 of 1,536 weight elements off
  by > 4e-3, worst 2.1e-2, and the same, 6 elements, for ZeRO-2), beyond the 0.1% budget of
  ``assert_params_match``; bf16 is checked with SGD.
"""

import pytest
import torch
import torch.nn.functional as F
from equivalence import STEPS, assert_layout_matches, engine_run, setup
from harness import run_distributed
from models import MODELS, make_data, make_model
from one_process import reference_run

import shardwise
from shardwise import comm

CLIP = 0.05
CPU = {"device": "cpu"}

# (name, model, dp, gas, dtype, optimizer, extra zero_optimization keys)
LAYOUTS = [
    ("z3-dp2-fp32", "tiny", 2, 1, "fp32", "sgd", {}),
    ("z3-dp2-gas3-fp32", "tiny", 2, 3, "fp32", "sgd", {}),
    ("z3-dp4-fp32-noprefetch", "tiny", 4, 1, "fp32", "sgd", {"stage3_prefetch_bucket_size": 0}),
    ("z3-dp4-gas3-fp32-live600", "tiny", 4, 3, "fp32", "sgd", {"stage3_max_live_parameters": 600}),
    ("z3-dp2-bf16", "tiny", 2, 1, "bf16", "sgd", {}),
    ("z3-dp2-gas3-bf16", "tiny", 2, 3, "bf16", "sgd", {}),
    ("z3-dp4-bf16", "tiny", 4, 1, "bf16", "sgd", {}),
    ("z3-dp4-gas3-bf16", "tiny", 4, 3, "bf16", "sgd", {}),
    ("z3-dp2-adamw", "tiny", 2, 1, "fp32", "adamw", {}),
    ("z3-dp4-gas3-adamw", "tiny", 4, 3, "fp32", "adamw", {}),
    # biases (32, 32, 4 elements) whole and all-reduced, weights sharded
    (
        "z3-dp4-gas3-persist40",
        "tiny",
        4,
        3,
        "fp32",
        "sgd",
        {"stage3_param_persistence_threshold": 40},
    ),
    (
        "z3-dp2-gas3-bf16-persist40",
        "tiny",
        2,
        3,
        "bf16",
        "sgd",
        {"stage3_param_persistence_threshold": 40},
    ),
    # 119- and 32-element units, a 1-element parameter: shards of pure padding on some ranks
    ("z3-dp4-uneven", "uneven", 4, 1, "fp32", "sgd", {}),
    ("z3-dp2-gas3-uneven-bf16", "uneven", 2, 3, "bf16", "sgd", {}),
    # a module called twice per forward and a weight tied across two modules
    ("z3-dp4-gas3-tied", "tied", 4, 3, "fp32", "sgd", {}),
    # shards kept on the offload device between uses, gathered to the compute device
    ("z3-dp2-gas3-offload-param", "tiny", 2, 3, "fp32", "adamw", {"offload_param": CPU}),
    (
        "z3-dp4-bf16-offload-param-and-optimizer",
        "tiny",
        4,
        1,
        "bf16",
        "sgd",
        {"offload_param": CPU, "offload_optimizer": CPU, "stage3_param_persistence_threshold": 40},
    ),
]


def zero3(**extra) -> dict:
    """Stage 3 with every parameter sharded unless a row says otherwise."""
    return {"stage": 3, "stage3_param_persistence_threshold": 0, **extra}


def with_model(model: str, fn, *args, **kwargs):
    """Run ``fn`` with ``equivalence.make_model`` pointing at another test model (the
    equivalence engine_run builds ``make_model()``); restored afterwards."""
    import equivalence

    saved = equivalence.make_model
    equivalence.make_model = MODELS[model]
    try:
        return fn(*args, **kwargs)
    finally:
        equivalence.make_model = saved


@pytest.mark.parametrize(
    "name,model,dp,gas,dtype,opt_name,zero_extra", LAYOUTS, ids=[row[0] for row in LAYOUTS]
)
def test_layout_trains_like_one_process(name, model, dp, gas, dtype, opt_name, zero_extra):
    want = reference_run(setup(dp, gas, CLIP, opt_name, dtype, model=MODELS[model]), STEPS)
    extra = {"zero_optimization": zero3(**zero_extra)}
    if dtype == "bf16":
        extra["bf16"] = {"enabled": True}
    results = run_distributed(with_model, dp, model, engine_run, dp, gas, CLIP, opt_name, **extra)
    assert_layout_matches(results, want, name, opt_name, dtype, CLIP)
    for rank, got in enumerate(results):
        assert got["memory"]["comm_buffers"] == 0, f"{name} rank {rank}: gathered buffers left"


def test_offload_param_keeps_each_shard_on_the_offload_device_and_nothing_whole():
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero3(offload_param={"device": "cpu", "pin_memory": True}),
    }
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    x, y = make_data(2)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    compute = next(iter(engine.strategy.units)).compute_device
    for i, u in enumerate(engine.strategy.units):
        tag = f"unit {i}"
        assert u.shard.device == torch.device("cpu"), f"{tag}: shard on {u.shard.device}"
        assert u.compute_device == compute, f"{tag}: computes on {u.compute_device}"
        assert u.full is None and all(p.numel() == 0 for p in u.params), f"{tag}: left whole"
        assert u.grad_shard.device == compute, f"{tag}: gradient shard off the compute device"


# ----------------------------------------------------------------------------- memory
DIMS = {"d_in": 6, "hidden": 9, "d_out": 2}
PSI = 6 * 9 + 9 + 9 * 9 + 9 + 9 * 2 + 2  # 173: odd, so no N divides it (units 63, 90, 20)
UNITS = 3
ADAM = {"type": "AdamW", "params": {"lr": 1e-3}}
# bytes per element of the padded total P, all divided by N: (params, grads, optimizer)
FORMULAS = {"fp32": (4, 4, 8), "bf16": (2, 2, 4 + 8)}


def _measure(dtype: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": ADAM,
        "zero_optimization": zero3(),
        "bf16": {"enabled": dtype == "bf16"},
    }
    engine, *_ = shardwise.initialize(model=make_model(**DIMS), config=config)
    x, y = make_data(2, d_in=DIMS["d_in"], d_out=DIMS["d_out"])
    out = engine(x)
    engine.backward(F.mse_loss(out, y.to(out.dtype)))
    engine.step()
    padded = sum(u.layout.padded for u in engine.strategy.units)
    return {"memory": engine.memory_breakdown(), "padded": padded}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", sorted(FORMULAS))
def test_model_states_are_sixteen_psi_over_n(dtype, n):
    got = run_distributed(_measure, n, dtype)[0]
    mem, padded = got["memory"], got["padded"]
    tag = f"stage 3 {dtype} N={n}"
    assert 0 <= padded - PSI < n * UNITS, f"{tag}: padding {padded - PSI} must stay below N/unit"
    for kind, per_element in zip(("params", "grads", "optimizer"), FORMULAS[dtype], strict=True):
        want = per_element * padded // n
        assert mem[kind] == want, f"{tag}: {kind} holds {mem[kind]} bytes, formula says {want}"
    assert mem["total"] == 16 * padded // n, f"{tag}: total {mem['total']} != 16 P / N"
    assert mem["comm_buffers"] == 0, f"{tag}: buffers left alive after the step"


# ----------------------------------------------------------------------------- traffic, shards
def _live(param) -> bool:
    return param._shardwise_unit.full is not None


def _traffic(stage: int, zero_extra: dict, steps: int = 2) -> dict:
    """Bytes sent per op over ``steps`` steps after a warm-up step (the first forward records
    the order prefetch follows); for stage 3, what each rank holds between and during steps."""
    zero = zero3(**zero_extra) if stage == 3 else {"stage": 0}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": zero,
    }
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    model, seen = engine.module, {}
    if stage == 3:
        # Registered after the strategy's hooks, so they see what its hooks have done.
        def forward_spy(module, args):  # fc1 starts: fc1 whole; fc2, head prefetched?
            seen.update(fc1=tuple(model.fc1.weight.shape), fc2=_live(model.fc2.weight))
            seen.update(head=_live(model.head.weight))

        def backward_spy(module, args, output):  # fc2's backward starts: fc1 prefetched?
            output.register_hook(lambda grad: seen.update(bwd_fc1=_live(model.fc1.weight)))

        model.fc1.register_forward_pre_hook(forward_spy)
        model.fc2.register_forward_hook(backward_spy)
    x, y = make_data(4 * (steps + 1))
    for k in range(steps + 1):
        if k == 1:
            comm.reset_stats()
        engine.backward(F.mse_loss(engine(x[4 * k : 4 * k + 4]), y[4 * k : 4 * k + 4]))
        engine.step()
    sent = {op: v["sent_bytes"] for op, v in comm.stats().items()}
    held = {n: p.numel() for n, p in model.named_parameters()}
    shards = sum(u.shard.numel() for u in getattr(engine.strategy, "units", []))
    return {"sent": sent, "held": held, "shards": shards, "seen": seen}


# (name, N, zero_optimization keys, live units seen by the spies). Units: fc1 544 elements,
# fc2 1056, head 132. A 1-element prefetch bucket fetches exactly the next unit; a live budget
# of 1,000 elements leaves no room for fc2 beside fc1, nor for fc1 beside fc2 in backward
# (it limits prefetch only: the gathers a module needs always happen).
TRAFFIC = [
    ("dp2-prefetch1", 2, {"stage3_prefetch_bucket_size": 1}, (True, False, True)),
    ("dp4-prefetch1", 4, {"stage3_prefetch_bucket_size": 1}, (True, False, True)),
    ("dp2-prefetch-all", 2, {}, (True, True, True)),
    ("dp4-live1000", 4, {"stage3_max_live_parameters": 1000}, (False, False, False)),
]


@pytest.mark.parametrize("name,n,zero_extra,live", TRAFFIC, ids=[t[0] for t in TRAFFIC])
def test_volume_is_one_and_a_half_dp_and_params_stay_sharded(name, n, zero_extra, live):
    z3 = run_distributed(_traffic, n, 3, zero_extra)
    dp = run_distributed(_traffic, n, 0, {})[0]
    tag = f"stage 3 {name}"
    gathered = z3[0]["sent"]["all_gather"] + z3[0]["sent"]["reduce_scatter"]
    ratio = gathered / dp["sent"]["all_reduce"]
    assert ratio == pytest.approx(1.5, rel=0.02), f"{tag}: sent {ratio:.3f}x DP, theory 1.5x"
    psi = sum(make_model().state_dict()[k].numel() for k in dp["held"])
    want = dict(zip(("fc2", "head", "bwd_fc1"), live, strict=True), fc1=(32, 16))
    for rank, got in enumerate(z3):
        assert all(v == 0 for v in got["held"].values()), f"{tag} rank {rank}: whole params kept"
        assert got["shards"] == psi // n, f"{tag} rank {rank}: holds {got['shards']} != Psi/N"
        assert got["seen"] == want, f"{tag} rank {rank}: live units {got['seen']}, want {want}"
