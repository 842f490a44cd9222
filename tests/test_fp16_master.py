"""``fp16.fp16_master_weights_and_grads``: DeepSpeed's ZeRO-2 + CPU offload mode where the
master weights and the gradient shards stay in fp16 and DeepSpeedCPUAdam keeps its moments in
fp32 (DeepSpeed v0.16.5, runtime/zero/stage_1_and_2.py), with DeepSpeed's restrictions: fp16
on, ZeRO stage 2, the optimizer offloaded to the CPU and stepped by DeepSpeedCPUAdam.

The reference is one process by hand: an fp16 model, each rank's fp16 gradient halved and
summed in fp16 (what the reduce-scatter computes), unscaled in fp16, then DeepSpeedCPUAdam on
the fp16 weights themselves (its update runs in fp32 and is rounded into them once). Two terms
summed in fp16 round the same in any order and 1/S is a power of two, so the run should match
bit for bit; we allow one fp16 ulp of the weights (|w| < 1: 2^-11 ~ 5e-4) and 1e-3 relative on
the loss, in case a kernel rounds differently. DeepSpeed refuses the key outside ZeRO-2 with
offload and DeepSpeedCPUAdam; so does shardwise, naming the key.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from models import make_data, make_model, rank_slice

import shardwise
from shardwise.config import ConfigError, parse_config
from shardwise.ops.adam import DeepSpeedCPUAdam

MB, STEPS, WORLD, S = 4, 6, 2, 256.0
FP16 = {"enabled": True, "fp16_master_weights_and_grads": True, "initial_scale_power": 8}
CONFIG = {
    "train_micro_batch_size_per_gpu": MB,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "fp16": FP16,
    "zero_optimization": {"stage": 2, "cpu_offload": True},  # the CIFAR config's spelling
}


def _train() -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cpu_offload is the deprecated spelling
        engine, *_ = shardwise.initialize(model=make_model(), config=CONFIG)
    x, y = make_data(MB * WORLD)
    losses = []
    for _ in range(STEPS):
        rows = rank_slice(0, 0, engine.global_rank, MB, WORLD, 1)  # one batch, fitted
        loss = F.mse_loss(engine(x[rows]).float(), y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    strategy, opt = engine.strategy, engine.optimizer
    return {
        "losses": losses,
        "params": {k: v.float() for k, v in engine.consolidated_state_dict().items()},
        "masters": sorted({str((b.master.dtype, b.master.device)) for b in strategy.buckets}),
        "grad_shards": sorted({str(b.grad_shard.dtype) for b in strategy.buckets}),
        "states": sorted({str(t.dtype) for s in opt.state.values() for t in s.values() if t.dim()}),
        "optimizer": type(opt).__name__,
    }


def _reference() -> dict:
    model = make_model().half()
    opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    x, y = make_data(MB * WORLD)
    losses = []
    for _ in range(STEPS):
        grads = []
        for rank in range(WORLD):
            rows = rank_slice(0, 0, rank, MB, WORLD, 1)
            loss = F.mse_loss(model(x[rows].half()).float(), y[rows])
            model.zero_grad()
            (loss * S).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            if rank == 0:
                losses.append(loss.item())
        for p, *gs in zip(model.parameters(), *grads, strict=True):
            p.grad = sum(g / WORLD for g in gs) * (1 / S)  # fp16 throughout
        opt.step()
    return {"losses": losses, "params": {k: v.float() for k, v in model.state_dict().items()}}


def test_fp16_masters_and_gradients_train_like_the_hand_reference():
    got = run_distributed(_train, WORLD)[0]
    ref = _reference()
    assert got["optimizer"] == "DeepSpeedCPUAdam", "an Adam block becomes DeepSpeedCPUAdam"
    assert got["masters"] == [str((torch.float16, torch.device("cpu")))], got["masters"]
    assert got["grad_shards"] == ["torch.float16"], got["grad_shards"]
    assert got["states"] == ["torch.float32"], "DeepSpeedCPUAdam keeps fp32 moments"
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-3), "losses"
    for name, want in ref["params"].items():
        diff = (got["params"][name] - want).abs().max().item()
        assert diff <= 2**-11, f"{name}: {diff:.2e} from the reference (one fp16 ulp allowed)"
    assert got["losses"][-1] < got["losses"][0], f"it trains: {got['losses']}"


def _refused_at_initialize(config: dict, optimizer=None) -> ConfigError:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError) as info:
            shardwise.initialize(model=make_model(), optimizer=optimizer, config=config)
    return info.value


@pytest.mark.parametrize(
    "zero, text",
    [
        ({"stage": 1, "cpu_offload": True}, "only supported with ZeRO stage 2"),
        ({"stage": 3}, "only supported with ZeRO stage 2"),
        ({"stage": 2}, "needs ZeRO-Offload"),
    ],
)
def test_deepspeeds_restrictions_are_refused_naming_the_key(zero, text):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=text) as info:
            parse_config({**CONFIG, "zero_optimization": zero})
    assert info.value.key == "fp16.fp16_master_weights_and_grads", zero


@pytest.mark.parametrize(
    "optimizer",
    [
        {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        {"type": "SGD", "params": {"lr": 1e-3}},
    ],
)
def test_an_optimizer_other_than_cpu_adam_is_refused(optimizer):
    error = _refused_at_initialize({**CONFIG, "optimizer": optimizer})
    assert error.key == "fp16.fp16_master_weights_and_grads"
    assert "DeepSpeedCPUAdam" in str(error), str(error)


def test_without_fp16_the_key_means_nothing_as_in_deepspeed():
    config = {**CONFIG, "fp16": {**FP16, "enabled": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = shardwise.initialize(model=make_model(), config=config)
    assert all(b.master.dtype == torch.float32 for b in engine.strategy.buckets)
