"""Models too big for one rank: built under ``shardwise.zero.Init()`` or on the meta device,
they train exactly like the same model built whole; ``GatheredParameters`` reads and changes
whole parameters of a partitioned model.

Tolerance: none. Every way of building draws the same random numbers in the same order (Init:
one module at a time, for real; meta: ``reset_parameters`` in ``modules()`` order, right after
the same seed), the shards are exact copies, and training then runs the same arithmetic on the
same values: losses and final parameters must be bit-for-bit equal to the whole-built run.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from models import MODELS, make_data, make_model, rank_slice

import shardwise
import shardwise.zero
from shardwise import comm

MB, STEPS = 4, 3


def _config(dtype: str, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
        "bf16": {"enabled": dtype == "bf16"},
    }


def _build(model: str, how: str, config: dict):
    """The model built ``how``; with the facts about what each rank holds after building."""
    factory = MODELS[model]
    if how == "whole":
        return factory(seed=0), {}
    if how in ("init", "init-config"):
        kwargs = {"config_dict_or_path": config} if how == "init-config" else {}
        with shardwise.zero.Init(**kwargs):
            built = factory(seed=0)
        held = {
            n: (p.numel(), p.ds_tensor.numel(), math.ceil(p.ds_numel / comm.get_world_size()))
            for n, p in built.named_parameters()
        }
        return built, held
    with torch.device("meta"):
        built = factory(seed=0)
    torch.manual_seed(0)  # what a whole build draws from: seed right before materializing
    if how == "meta-Init(module)":
        shardwise.zero.Init(module=built)
    return built, {}


def _train(model: str, how: str, dtype: str) -> dict:
    config = _config(dtype)
    built, held = _build(model, how, config)
    engine, *_ = shardwise.initialize(model=built, config=config)
    first = engine.consolidated_state_dict()
    dp, rank = engine.dp_world_size, engine.dp_rank
    x, y = make_data(MB * dp * STEPS)
    losses = []
    for k in range(STEPS):
        rows = rank_slice(k, 0, rank, MB, dp, 1)
        out = engine(x[rows])
        loss = F.mse_loss(out, y[rows].to(out.dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {
        "first": first,
        "last": engine.consolidated_state_dict(),
        "losses": losses,
        "held": held,
    }


def _both(model: str, how: str, dtype: str) -> tuple[dict, dict]:
    return _train(model, "whole", dtype), _train(model, how, dtype)


# (name, model, how, dp, dtype)
BUILDS = [
    ("Init-uneven-dp4", "uneven", "init", 4, "fp32"),  # apply() init on a nested Linear
    ("Init(config)-tiny-dp2-bf16", "tiny", "init-config", 2, "bf16"),  # shards made in bf16
    ("meta-tiny-dp2", "tiny", "meta", 2, "fp32"),  # materialized by initialize()
    ("meta-Init(module)-tiny-dp4-bf16", "tiny", "meta-Init(module)", 4, "bf16"),
]


@pytest.mark.parametrize("name,model,how,dp,dtype", BUILDS, ids=[b[0] for b in BUILDS])
def test_partitioned_build_trains_like_whole_build(name, model, how, dp, dtype):
    for rank, (whole, built) in enumerate(run_distributed(_both, dp, model, how, dtype)):
        tag = f"build {name} rank {rank}"
        for key in ("first", "last"):
            for k, v in whole[key].items():
                assert torch.equal(built[key][k], v), f"{tag}: {key} {k} differs from whole build"
        assert built["losses"] == whole["losses"], f"{tag}: losses differ from whole build"
        for n, (numel, shard, want) in built["held"].items():
            assert numel == 0, f"{tag}: {n} is whole ({numel} elements) after Init"
            assert shard == want, f"{tag}: {n} shard has {shard} elements, not ceil(numel/N)={want}"


def _gathered() -> dict:
    """GatheredParameters before initialize (Init shards) and after (strategy units, bf16 with
    fp32 masters; biases of 32 and 4 elements persistent, so whole on every rank)."""
    rank = comm.get_rank()
    with shardwise.zero.Init():
        model = make_model()
    fc1 = model.fc1.weight
    with shardwise.zero.GatheredParameters(fc1, modifier_rank=1), torch.no_grad():
        seen = tuple(fc1.shape)
        if rank == 1:
            fc1.fill_(0.25)
    after_init = fc1.numel()
    config = _config("bf16", stage3_param_persistence_threshold=40)
    engine, *_ = shardwise.initialize(model=model, config=config)
    m = engine.module
    with shardwise.zero.GatheredParameters([m.fc2.weight, m.head.bias], modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                m.fc2.weight.fill_(0.5)
                m.head.bias.fill_(-1.0)
    with shardwise.zero.GatheredParameters(m.head.weight), torch.no_grad():
        m.head.weight.fill_(7.0)  # no modifier_rank: discarded on exit
    changed = engine.consolidated_state_dict()
    x, y = make_data(MB)
    engine.backward(F.mse_loss(engine(x), y.to(torch.bfloat16)))
    engine.step()
    return {
        "seen": seen,
        "after_init": after_init,
        "changed": changed,
        "stepped": engine.consolidated_state_dict(),
    }


def test_gathered_parameters_with_modifier_rank():
    results = run_distributed(_gathered, 2)
    whole = {k: v.to(torch.bfloat16) for k, v in make_model().state_dict().items()}
    for rank, got in enumerate(results):
        tag = f"GatheredParameters dp2 rank {rank}"
        assert got["seen"] == (32, 16), f"{tag}: whole shape inside the block, saw {got['seen']}"
        assert got["after_init"] == 0, f"{tag}: the Init parameter stayed whole after the block"
        changed, stepped = got["changed"], got["stepped"]
        assert (changed["fc1.weight"] == 0.25).all(), f"{tag}: rank 1's change (Init) was lost"
        assert (changed["fc2.weight"] == 0.5).all(), f"{tag}: rank 0's change (sharded) was lost"
        assert (changed["head.bias"] == -1).all(), f"{tag}: rank 0's change (persistent) was lost"
        assert torch.equal(changed["head.weight"], whole["head.weight"]), (
            f"{tag}: a change without modifier_rank must be discarded"
        )
        # One clipped SGD step moves a weight by < 0.01; a master left stale would put
        # fc2.weight back to its random initial values (|w| up to 0.18).
        for k, v in (("fc2.weight", 0.5), ("head.bias", -1.0)):
            drift = (stepped[k].float() - v).abs().max()
            assert drift < 0.02, f"{tag}: {k} moved {drift:.3f} from the value set: stale master"
        assert torch.equal(stepped["fc2.weight"], results[0]["stepped"]["fc2.weight"]), tag


def _stage2_with_init_model() -> str:
    with shardwise.zero.Init():
        model = make_model()
    try:
        shardwise.initialize(
            model=model, config={**_config("fp32"), "zero_optimization": {"stage": 2}}
        )
    except shardwise.ConfigError as err:
        return str(err)
    return "no error"


def test_partitioned_model_needs_stage_3():
    message = run_distributed(_stage2_with_init_model, 2)[0]
    assert "zero_optimization.stage" in message and "stage 3" in message.lower(), message
