"""What composes with 1F1B composes with the zero-bubble schedules: data parallelism and ZeRO-1/2,
tensor parallelism, fp16 loss scaling with clipping, checkpoints that load across schedules.

Rows against one process (4 steps, the table of test_pipe_equivalence.py, its tolerances: 1e-5
relative on losses and norms, 1e-6 absolute on parameters; measured 1e-7 and 1e-8 there).

fp16 with dynamic loss scaling: ZB-H1 against 1F1B in the same world. Both compute the same
products (B + W is the fused backward bit for bit) and add each parameter's micro-batch
gradients in the same order (W's run in micro-batch order), so every loss, loss scale and
weight must be equal bit for bit, overflow steps included.

Checkpoints: names are layer indices whatever the placement, so a ZBV checkpoint (two chunks in
a V) loads into 1F1B on another pipeline size and continues with the same weights and the same
next loss, and back.
"""

import pytest
import torch
from harness import run_distributed
from one_process import reference_run
from pipe_models import BLOCKS_PLAN, micro_batches, pipeline_module, setup

import shardwise

STEPS, MB, LR, CLIP = 4, 2, 0.1, 0.05

ROWS = [  # (name, model, dp, pp, schedule, micro-batches, options)
    ("dp2-pp2-zbv-zero1", "mlp", 2, 2, "zbv", 4, {"zero": 1}),
    ("dp2-pp2-zb-h1-zero2-tied", "lm", 2, 2, "zb-h1", 4, {"zero": 2}),
    ("dp2-pp2-dualpipev-plain-tied", "lm", 2, 2, "dualpipev", 4, {}),
    ("tp2-pp2-zb-h1", "blocks", 1, 2, "zb-h1", 3, {"tp": 2}),
    ("tp2-pp2-zbv-ckpt", "blocks", 1, 2, "zbv", 4, {"tp": 2, "activation_checkpoint_interval": 1}),
]


def _config(schedule, gas, zero=0, tp=1, **extra):
    chunks = 2 if schedule in ("zbv", "dualpipev") else 1
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "pipeline": {"schedule": schedule, "chunks": chunks},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 300},
        "tensor_parallel": {"size": tp, "plan": BLOCKS_PLAN if tp > 1 else None},
        **extra,
    }


def _module(model, pp, schedule, **options):
    if schedule in ("zbv", "dualpipev"):
        options.update(chunks=2, placement="v")
    return pipeline_module(model, pp, **options)


def _train(model, pp, schedule, gas, options):
    options = dict(options)
    config = _config(schedule, gas, options.pop("zero", 0), options.pop("tp", 1))
    engine, *_ = shardwise.initialize(model=_module(model, pp, schedule, **options), config=config)
    data = micro_batches(model, engine, MB, gas, STEPS)
    reads = engine.is_first_stage() or engine.is_last_stage()
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data if reads else None).item())
        norms.append(engine.get_global_grad_norm())
    params = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params}


@pytest.mark.parametrize("name,model,dp,pp,schedule,gas,options", ROWS, ids=[r[0] for r in ROWS])
def test_zero_bubble_layout_trains_like_one_process(name, model, dp, pp, schedule, gas, options):
    want = reference_run(setup(model, dp, gas, MB, STEPS, LR, CLIP), STEPS)
    assert max(want["norms"]) > CLIP, f"{name}: clipping never engaged; the test is void"
    world = dp * pp * options.get("tp", 1)
    for rank, got in enumerate(run_distributed(_train, world, model, pp, schedule, gas, options)):
        tag = f"layout {name} rank {rank}"
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), tag
        assert got["norms"] == pytest.approx(want["norms"], rel=2e-5), tag
        for k, w in want["params"].items():
            diff = (got["params"][k] - w).abs().max().item()
            assert diff <= 1e-6, f"{tag}: {k} differs by {diff:.2e}"


def _fp16(schedule):
    fp16 = {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 2}  # overflows early
    config = _config(schedule, 4, fp16=fp16)
    engine, *_ = shardwise.initialize(model=_module("mlp", 2, schedule), config=config)
    data = micro_batches("mlp", engine, MB, 4, 6)
    reads = engine.is_first_stage() or engine.is_last_stage()
    losses, scales = [], []
    for _ in range(6):
        losses.append(engine.train_batch(data if reads else None).item())
        scales.append(engine.scaler.scale)
    return losses, scales, engine.consolidated_state_dict()


def _fp16_both():
    return _fp16("1f1b"), _fp16("zb-h1")


def test_fp16_loss_scaling_under_zb_h1_is_1f1b_bit_for_bit():
    for ofob, zb in run_distributed(_fp16_both, 2):
        assert zb[0] == ofob[0] and zb[1] == ofob[1], (zb[:2], ofob[:2])
        assert len(set(ofob[1])) > 1, "the loss scale never moved: no overflow was tested"
        for k, v in ofob[2].items():
            assert torch.equal(zb[2][k], v), k


def _save_or_load(pp, schedule, path, load):
    """Two steps then save (or load what was saved), then one more step (lm, tied)."""
    torch.manual_seed(1 if load else 0)  # a loaded engine must not depend on its own start
    config = _config(schedule, 4)
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01}}
    engine, *_ = shardwise.initialize(model=_module("lm", pp, schedule), config=config)
    data = micro_batches("lm", engine, MB, 4, 3)
    reads = engine.is_first_stage() or engine.is_last_stage()
    if load:
        engine.load_checkpoint(path, tag="t")
        for _ in range(8):  # the two batches the saving run trained on
            next(data)
    else:
        for _ in range(2):
            engine.train_batch(data if reads else None)
        engine.save_checkpoint(path, tag="t")
    weights = engine.consolidated_state_dict()
    return {"weights": weights, "next_loss": engine.train_batch(data if reads else None).item()}


@pytest.mark.parametrize("saver,loader", [(("zbv", 2), ("1f1b", 2)), (("1f1b", 2), ("zbv", 2))])
def test_a_checkpoint_loads_across_schedules(tmp_path, saver, loader):
    path = str(tmp_path)
    saved = run_distributed(_save_or_load, saver[1], saver[1], saver[0], path, False)[0]
    loaded = run_distributed(_save_or_load, loader[1], loader[1], loader[0], path, True)[0]
    assert saved["weights"].keys() == loaded["weights"].keys()
    for k, v in saved["weights"].items():
        assert torch.equal(v, loaded["weights"][k]), k
    assert loaded["next_loss"] == pytest.approx(saved["next_loss"], rel=1e-6)
