"""Exact resume: 3 steps, save, a fresh engine loads, 3 more steps == 6 uninterrupted steps,
bit for bit on CPU (one thread per rank), in every layout.

What must come back for that: weights, fp32 masters, optimizer states (AdamW's moments and
step), the LR schedule (WarmupLR is still warming up at the save), the fp16 loss scale, the
counters, every rank's random generators (dropout is on; under tensor parallelism also the
per-TP-rank stream of the "split_dropout" regions) and the data loader's position (the runs
cross an epoch boundary). The fresh engine starts from other random weights and other random
streams, so nothing passes by accident. Adding a layout is one line in RESUME.
"""

import pytest
import torch
from checkpointing import MLP_PLAN, PIPE_PLAN, DropMLP, config, engine_for, load, save, train
from harness import run_distributed
from safetensors.torch import load_file

import shardwise
from shardwise.checkpoint.reshard import CheckpointError

FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 40}  # biases whole, weights sharded

TP2 = {"size": 2, "plan": MLP_PLAN}
CPU = {"device": "cpu"}
RESUME = {  # name: (world size, config keys[, model]: checkpointing.MODELS, "mlp" if not given)
    "single": (1, {}),
    "dp2": (2, {}),
    "zero1-dp2": (2, {"zero_optimization": {"stage": 1}}),
    "zero2-dp2": (2, {"zero_optimization": {"stage": 2}}),
    "zero3-dp2": (2, {"zero_optimization": Z3}),
    # shards in host memory between uses, master and Adam states there too
    "zero3-offload-dp2": (
        2,
        {"zero_optimization": {**Z3, "offload_param": CPU, "offload_optimizer": CPU}},
    ),
    "bf16-dp2": (2, {"bf16": {"enabled": True}}),  # ZeRO-0: replicated fp32 masters
    "bf16-zero2-dp2": (2, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}),
    "fp16-dp2": (2, {"fp16": FP16}),
    "zero1-gas2-dp2": (2, {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}),
    "tp2": (2, {"tensor_parallel": TP2}),
    "zero1-dp2-tp2": (4, {"tensor_parallel": TP2, "zero_optimization": {"stage": 1}}),
    "pp2": (2, {"pipeline": {"stages": 2}}, "pipe"),
    "zero1-dp2-pp2": (4, {"pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}}, "pipe"),
    "tp2-pp2": (
        4,
        {"pipeline": {"stages": 2}, "tensor_parallel": {"size": 2, "plan": PIPE_PLAN}},
        "pipe",
    ),
    "gpt-zero2-dp2-tp2": (
        4,
        {"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 2}},
        "gpt",
    ),
}


def on_world(world: int, fn, *args):
    """Per-rank results: in this process for one rank, else on a persistent gloo world."""
    return [fn(*args)] if world == 1 else run_distributed(fn, world, *args)


def _resume(cfg: dict, path: str, model: str) -> dict:
    whole = train(cfg, 6, 0.1, model=model)
    first = train(cfg, 3, 0.1, save_to=path, model=model)
    second = train(cfg, 3, 0.1, load_from=path, model=model)
    return {"whole": whole, "first": first, "second": second}


@pytest.mark.parametrize("name", list(RESUME))
def test_resume_is_bit_exact(name, tmp_path):
    world, extra, *model = RESUME[name]
    args = (config(**extra), str(tmp_path), model[0] if model else "mlp")
    for rank, r in enumerate(on_world(world, _resume, *args)):
        tag = f"layout {name} rank {rank}"
        whole, first, second = r["whole"], r["first"], r["second"]
        assert first["losses"] == whole["losses"][:3], tag
        assert second["losses"] == whole["losses"][3:], f"{tag}: losses after the resume"
        for k, w in whole["params"].items():
            assert torch.equal(second["params"][k], w), f"{tag}: {k} differs after the resume"
        assert second["client"] == {"step": 3, "note": "hello"}, tag
        for key in ("global_steps", "global_samples", "lr", "scale"):
            assert second[key] == whole[key], f"{tag}: {key}"
    assert (tmp_path / "latest").read_text().strip() == "global_step3", name


def test_nothing_to_load_returns_none(tmp_path):
    engine = engine_for(config(), 0.0, seed=0)
    assert load(engine, str(tmp_path)) == (None, None)


def _partial_loads(path: str) -> dict:
    cfg = config(zero_optimization={"stage": 1})
    saved = train(cfg, 3, save_to=path)
    out = {"saved": saved["params"]}
    for kw in ({"load_optimizer_states": False}, {"load_module_only": True}):
        engine = engine_for(cfg, 0.0, seed=99)
        load(engine, path, **kw)
        key = next(iter(kw))
        out[key] = {
            "params": {k: v.float() for k, v in engine.consolidated_state_dict().items()},
            "opt_state": sum(len(s) for s in engine.optimizer.state.values()),
            "global_steps": engine.global_steps,
            "lr": engine.get_lr(),
        }
    return out


def test_partial_loads_skip_what_deepspeed_skips(tmp_path):
    for rank, r in enumerate(run_distributed(_partial_loads, 2, str(tmp_path))):
        for key, expect_steps in (("load_optimizer_states", 3), ("load_module_only", 0)):
            got, tag = r[key], f"{key}=... rank {rank}"
            for k, w in r["saved"].items():
                assert torch.equal(got["params"][k], w), f"{tag}: weights not loaded ({k})"
            assert got["opt_state"] == 0, f"{tag}: optimizer states were loaded"
            assert got["global_steps"] == expect_steps, tag
        assert r["load_optimizer_states"]["lr"] != [0.0], "the scheduler is restored"
        assert r["load_module_only"]["lr"] == [0.0], "load_module_only leaves the scheduler"


def _export(path: str) -> dict:
    cfg = config(zero_optimization=Z3, bf16={"enabled": True})
    engine = engine_for(cfg, 0.0, seed=0)
    engine.train_batch()
    engine.save_16bit_model(path, "model.safetensors")
    whole = engine.consolidated_state_dict()
    # And back: a whole state dict loads into the sharded layout.
    fresh = engine_for(cfg, 0.0, seed=99)
    fresh.load_module_state_dict(load_file(f"{path}/model.safetensors"))
    return {"whole": whole, "reloaded": fresh.consolidated_state_dict()}


def test_16bit_export_and_module_state_dict_under_zero3(tmp_path):
    results = run_distributed(_export, 2, str(tmp_path))
    exported = load_file(tmp_path / "model.safetensors")
    for rank, r in enumerate(results):
        assert exported.keys() == r["whole"].keys()
        for k, v in r["whole"].items():
            assert torch.equal(exported[k], v), f"rank {rank}: {k}"
            assert v.dtype == torch.bfloat16 or not v.is_floating_point(), f"{k}: {v.dtype}"
            assert torch.equal(r["reloaded"][k], v), f"rank {rank}: {k} not reloaded"


@pytest.mark.parametrize(
    "change, error",
    [
        ({"head": (32, 5)}, r"incompatible model.*'model/head.weight'.*\(4, 32\).*\(5, 32\)"),
        ({"fc1": None}, r"does not have: \['model/fc1.bias'\]"),
    ],
)
def test_another_model_is_refused_naming_the_tensor(tmp_path, change, error):
    engine = engine_for(config(), 0.0, seed=0)
    engine.train_batch()
    save(engine, str(tmp_path))
    model = DropMLP(0.0)
    for attr, shape in change.items():
        setattr(model, attr, torch.nn.Linear(*shape) if shape else torch.nn.Linear(16, 32, False))
    other, *_ = shardwise.initialize(model=model, config=config())
    with pytest.raises(CheckpointError, match=error):
        load(other, str(tmp_path))
