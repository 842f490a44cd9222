"""The engine with a pipeline: DeepSpeed's call rules, tied copies, and activation memory.

Memory: a saved-tensor hook books every tensor autograd stores for backward (parameters left
out; parallel/pipeline/meter.py). One micro-batch's bytes are measured with m = 1; with
m = 8 micro-batches on 4 stages GPipe stores all 8 on every stage, 1F1B at most 4 - s on stage
s (PipeDream-Flush; PTD-P 2.2.1). The counts are exact: the stored tensors of a micro-batch
have the same sizes whichever schedule runs it.
"""

import pytest
import torch
from harness import run_distributed
from pipe_models import make_batches, micro_batches, pipeline_module

import shardwise
from shardwise.pipe import PipelineModule

MB = 4
SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _engine(model, pp, gas, schedule="1f1b"):
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "optimizer": SGD,
        "pipeline": {"schedule": schedule},
    }
    engine, *_ = shardwise.initialize(model=pipeline_module(model, pp), config=config)
    return engine


def _peak_activations(schedule: str, gas: int) -> dict:
    engine = _engine("mlp", 4, gas, schedule)
    engine.pipeline.track_activations()
    reads = engine.is_first_stage() or engine.is_last_stage()
    engine.train_batch(micro_batches("mlp", engine, MB, gas, 1) if reads else None)
    return {
        "bytes": engine.pipeline.peak_activation_bytes,
        "in_flight": engine.pipeline.peak_in_flight,
        "stage": engine.pipeline.stage_id,
    }


def test_1f1b_stores_at_most_stages_minus_stage_id_micro_batches_gpipe_all():
    one = run_distributed(_peak_activations, 4, "gpipe", 1)
    gpipe = run_distributed(_peak_activations, 4, "gpipe", 8)
    ofob = run_distributed(_peak_activations, 4, "1f1b", 8)
    for s in range(4):
        per_mb = one[s]["bytes"]
        assert per_mb > 0 and one[s]["stage"] == s
        assert gpipe[s]["bytes"] == 8 * per_mb, f"GPipe stage {s}: {gpipe[s]} vs {per_mb}/mb"
        assert ofob[s]["bytes"] == (4 - s) * per_mb, f"1F1B stage {s}: {ofob[s]} vs {per_mb}/mb"
        assert (gpipe[s]["in_flight"], ofob[s]["in_flight"]) == (8, 4 - s), f"stage {s}"


def _api_rules() -> dict:
    engine = _engine("mlp", 2, 2)
    seen = {"first": engine.is_first_stage(), "last": engine.is_last_stage()}
    x, y = make_batches("mlp", MB)
    for name, call in [
        ("forward", lambda: engine(x)),
        ("backward", lambda: engine.backward(torch.zeros((), requires_grad=True))),
        ("step", lambda: engine.step()),
    ]:
        with pytest.raises(shardwise.EngineError, match=r"use engine.train_batch\(data_iter\)"):
            call()
        seen[name] = "refused"
    with torch.no_grad(), pytest.raises(RuntimeError, match="requires gradients enabled"):
        engine.train_batch(iter([(x, y)] * 2))
    with pytest.raises(TypeError, match=r"must be an \(inputs, labels\) pair"):
        engine.train_batch(iter([x, x]))
    before = engine.consolidated_state_dict()
    seen["eval"] = engine.eval_batch(iter([(x, y)] * 2)).item()
    seen["eval_logits"] = engine.eval_batch(
        iter([(x, y)] * 2), return_logits=True, num_micro_batches=2
    )[1]
    after = engine.consolidated_state_dict()
    seen["eval_kept_weights"] = all(torch.equal(before[k], after[k]) for k in before)
    seen["train"] = engine.train_batch(iter([(x, y)] * 2)).item()
    seen["steps"] = (engine.global_steps, engine.micro_steps)
    seen["keys"] = list(after)
    return seen


def test_pipeline_engine_follows_deepspeed_rules():
    results = run_distributed(_api_rules, 2)
    keys = list(pipeline_module("mlp", 1).state_dict())  # one stage: the whole model
    for rank, seen in enumerate(results):
        tag = f"rank {rank}"
        assert (seen["first"], seen["last"]) == (rank == 0, rank == 1), tag
        assert seen["eval"] == results[0]["eval"] and seen["train"] == results[0]["train"], tag
        assert seen["eval"] == pytest.approx(seen["train"], rel=1e-6), f"{tag}: same weights"
        assert seen["eval_kept_weights"], f"{tag}: eval_batch changed the weights"
        assert seen["steps"] == (1, 2), f"{tag}: one step of two micro-batches"
        assert seen["keys"] == keys, f"{tag}: names of the one-stage module"
    assert results[0]["eval_logits"] is None
    assert tuple(results[1]["eval_logits"].shape) == (2 * MB, 4)


def _tied_copies() -> dict:
    engine = _engine("lm", 2, 2)
    data = micro_batches("lm", engine, MB, 2, 3)
    for _ in range(3):
        engine.train_batch(data)
    weight = engine.module.tied_modules["embed"].weight.detach().clone()
    return {"weight": weight}


def test_tied_copies_stay_identical_across_stages():
    first, last = run_distributed(_tied_copies, 2)
    assert torch.equal(first["weight"], last["weight"]), "the tied copies drifted apart"


CKPT_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
}


def _train_save_continue(pp: int, zero: int, path: str, load: bool) -> dict:
    """Two steps then save (or load what was saved), then one more step."""
    config = {**CKPT_CONFIG, "zero_optimization": {"stage": zero}}
    torch.manual_seed(1 if load else 0)  # a loaded engine must not depend on its own start
    module = pipeline_module("lm", pp, seed_layers=load)
    engine, *_ = shardwise.initialize(model=module, config=config)
    data = micro_batches("lm", engine, 2, 2, 3)
    if load:
        engine.load_checkpoint(path, tag="t")
        for _ in range(4):  # the two batches the saving run trained on
            next(data)
    else:
        for _ in range(2):
            engine.train_batch(data)
        engine.save_checkpoint(path, tag="t")
    weights = engine.consolidated_state_dict()
    return {"weights": weights, "next_loss": engine.train_batch(data).item()}


def test_a_pipeline_checkpoint_loads_into_another_pipeline_layout(tmp_path):
    """DP2 x PP2, ZeRO-1, tied embedding -> DP2 x PP1, ZeRO-2: the same weights, and the
    same next loss (same data-parallel size, so the same batches; Adam's state carried)."""
    path = str(tmp_path)
    saved = run_distributed(_train_save_continue, 4, 2, 1, path, False)[0]
    loaded = run_distributed(_train_save_continue, 2, 1, 2, path, True)[0]
    assert saved["weights"].keys() == loaded["weights"].keys()
    for k, v in saved["weights"].items():
        assert torch.equal(v, loaded["weights"][k]), k
    assert loaded["next_loss"] == pytest.approx(saved["next_loss"], rel=1e-6)


def _loss_after_replacing_the_loss_module() -> list[float]:
    torch.manual_seed(0)
    module = PipelineModule(
        [torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)], num_stages=2, loss_fn=torch.nn.MSELoss()
    )
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD}
    engine, *_ = shardwise.initialize(model=module, config=config)
    x, y = torch.ones(2, 4), torch.zeros(2, 2)
    out = []
    for loss_module in (torch.nn.MSELoss(), torch.nn.L1Loss(reduction="sum")):
        module.loss_fn = loss_module  # as a tensor-parallel plan swaps a loss module in place
        reads = engine.is_first_stage() or engine.is_last_stage()
        out.append(float(engine.eval_batch(iter([(x, y)]) if reads else None)))
    return out


def test_the_stage_runs_the_loss_module_the_tree_holds_now():
    for rank, (mse, l1_sum) in enumerate(run_distributed(_loss_after_replacing_the_loss_module, 2)):
        assert l1_sum != pytest.approx(mse), f"rank {rank}: the replaced loss module still ran"


def _loss_lines(pp: int) -> list:
    """The log lines of two steps with steps_per_print 2, pipeline or not, and the losses."""
    import logging

    config = {"train_micro_batch_size_per_gpu": MB, "optimizer": SGD, "steps_per_print": 2}
    # One stage: the plain micro-batch loop (DP2); two: the pipeline's schedule.
    engine, *_ = shardwise.initialize(model=pipeline_module("mlp", pp), config=config)
    lines: list = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    logging.getLogger("shardwise").addHandler(handler)
    try:
        batches = micro_batches("mlp", engine, MB, 1, 2)
        losses = [engine.train_batch(batches).item() for _ in range(2)]
    finally:
        logging.getLogger("shardwise").removeHandler(handler)
    return [[line for line in lines if line.startswith("steps: ")], losses]


@pytest.mark.parametrize("pp", [1, 2])
def test_train_batch_logs_deepspeeds_loss_line_every_steps_per_print(pp):
    results = run_distributed(_loss_lines, 2, pp)
    lines, losses = results[0]
    assert len(lines) == 1 and lines[0].startswith(
        f"steps: 2 loss: {losses[1]:0.4f} iter time (s): "
    ), (pp, lines)
    assert "samples/sec: " in lines[0], (pp, lines)
    assert results[1][0] == [], f"pp={pp}: only rank 0 logs"
