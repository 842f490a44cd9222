"""Pipeline layouts train like one process: the equivalence table.

Each row trains a PipelineModule through ``engine.train_batch`` for a few steps on the same
global batches as a plain one-process PyTorch loop (one_process.py, on pipe_models.setup) with
the same weights, SGD with momentum and clipping engaged (so the gradient norm must sum every
stage, each tied weight once). Compared on every rank: the loss of every step (train_batch's
return value), the gradient norm, and the final parameters gathered by
``consolidated_state_dict()`` under the one-process names.

Tolerance (fp32). A pipeline changes no arithmetic but the order of sums: the gradient of a
batch is accumulated over m micro-batches instead of one batched matmul (as gradient
accumulation does), data ranks average it, tied copies add their halves. Measured over the
table: losses within 1.0e-7 relative, norms 1.3e-7, parameters 1.5e-8 after 4 steps. Bounds:
1e-5 relative on losses and norms, 1e-6 absolute on parameters. Measured with the code broken
on purpose: tied gradients not summed (losses 7e-5, parameters 1.5e-3), tied copies counted
twice in the norm (8e-5, 9e-5), the norm of one stage only (6e-4, 3e-3), gradients reduced on
the first backward instead of the last (2e-3, 5e-3): every one fails.
bf16: each stage rounds its activations and gradients to bf16 (relative step 2^-8); measured
losses 9e-4, norms 2e-3, parameters 1e-3; bounds 1e-2 relative and 4e-3 absolute, as in
test_zero.py.
"""

import pytest
from harness import run_distributed
from one_process import reference_run
from pipe_models import BLOCKS_PLAN, micro_batches, pipeline_module, setup

import shardwise

STEPS, MB, LR, CLIP = 4, 2, 0.1, 0.05

# (name, model, dp, pp, schedule, micro-batches, extra config / module options)
ROWS = [
    ("pp2-gpipe-m1", "mlp", 1, 2, "gpipe", 1, {}),
    ("pp2-gpipe-m2", "mlp", 1, 2, "gpipe", 2, {}),
    ("pp2-gpipe-m8", "mlp", 1, 2, "gpipe", 8, {}),
    ("pp2-1f1b-m1", "mlp", 1, 2, "1f1b", 1, {}),
    ("pp2-1f1b-m2", "mlp", 1, 2, "1f1b", 2, {}),
    ("pp2-1f1b-m8", "mlp", 1, 2, "1f1b", 8, {}),
    ("pp4-gpipe-m1", "mlp", 1, 4, "gpipe", 1, {}),
    ("pp4-gpipe-m2", "mlp", 1, 4, "gpipe", 2, {"partition_method": "uniform"}),
    ("pp4-gpipe-m8", "mlp", 1, 4, "gpipe", 8, {}),
    ("pp4-1f1b-m1", "mlp", 1, 4, "1f1b", 1, {}),
    ("pp4-1f1b-m2", "mlp", 1, 4, "1f1b", 2, {"partition_method": "type:linear"}),
    ("pp4-1f1b-m8", "mlp", 1, 4, "1f1b", 8, {}),
    ("dp2-pp2-1f1b-m2", "mlp", 2, 2, "1f1b", 2, {}),
    ("dp2-pp2-zero1-m2", "mlp", 2, 2, "1f1b", 2, {"zero": 1}),
    ("dp2-pp2-zero2-m3", "mlp", 2, 2, "1f1b", 3, {"zero": 2}),
    ("pp2-ckpt-m2", "mlp", 1, 2, "1f1b", 2, {"activation_checkpoint_interval": 1}),
    ("pp2-tied-m2", "lm", 1, 2, "1f1b", 2, {}),
    ("pp4-tied-gpipe-m2", "lm", 1, 4, "gpipe", 2, {}),
    ("dp2-pp2-tied-m2", "lm", 2, 2, "1f1b", 2, {}),
    ("dp2-pp2-tied-zero1-m2", "lm", 2, 2, "1f1b", 2, {"zero": 1}),
    ("dp2-pp2-tied-zero2-m2", "lm", 2, 2, "gpipe", 2, {"zero": 2}),
    ("dp2-pp2-bf16-zero1-m2", "mlp", 2, 2, "1f1b", 2, {"zero": 1, "bf16": True}),
    ("pp2-interleaved-v2-m2", "mlp", 1, 2, "interleaved", 2, {"chunks": 2}),
    ("pp2-interleaved-v2-m4-tied", "lm", 1, 2, "interleaved", 4, {"chunks": 2}),
    ("dp2-pp2-interleaved-v2-zero2-m4", "mlp", 2, 2, "interleaved", 4, {"chunks": 2, "zero": 2}),
    ("tp2-pp2-1f1b-m2", "blocks", 1, 2, "1f1b", 2, {"tp": 2}),
    ("tp2-pp2-gpipe-zero1-m3", "blocks", 1, 2, "gpipe", 3, {"tp": 2, "zero": 1}),
    ("dp2-pp2-tp2-zero1-m2", "blocks", 2, 2, "1f1b", 2, {"tp": 2, "zero": 1}),  # 8 processes
    # A tied embedding (replicated over TP) on the first and last stage, and a plan naming the
    # stage's own layers ("1", "3"): their replacement must be what the stage runs (it once
    # kept running the unsplit layers, and the split ones, in the optimizer, never trained).
    ("tp2-pp2-tied-m2", "lm", 1, 2, "1f1b", 2, {"tp": 2, "plan": {"1": "colwise", "3": "rowwise"}}),
    # Checkpointed stage layers whose kept inputs are split over the TP pair.
    ("tp2-pp2-ckpt-partitioned-m2", "blocks", 1, 2, "1f1b", 2, {"tp": 2, "partition": True}),
]


def _train(model, pp, schedule, gas, options) -> dict:
    options = dict(options)
    zero, bf16, tp = options.pop("zero", 0), options.pop("bf16", False), options.pop("tp", 1)
    plan = options.pop("plan", BLOCKS_PLAN)
    partition = options.pop("partition", False)
    if partition:
        options["activation_checkpoint_interval"] = 1
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "pipeline": {"schedule": schedule},
        # Small buckets: several per stage, parameters straddling ZeRO shard boundaries.
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 300},
        "bf16": {"enabled": bf16},
        "tensor_parallel": {"size": tp, "plan": plan if tp > 1 else None},
        "activation_checkpointing": {"partition_activations": partition},
    }
    module = pipeline_module(model, pp, **options)
    engine, *_ = shardwise.initialize(model=module, config=config)
    assert (module.activation_partition.group is not None) == partition
    data = micro_batches(model, engine, MB, gas, STEPS)
    reads = engine.is_first_stage() or engine.is_last_stage()
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data if reads else None).item())
        norms.append(engine.get_global_grad_norm())
    params = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params, "stage": engine.pipeline.stage_id}


@pytest.mark.parametrize("name,model,dp,pp,schedule,gas,options", ROWS, ids=[r[0] for r in ROWS])
def test_pipeline_trains_like_one_process(name, model, dp, pp, schedule, gas, options):
    bf16 = options.get("bf16", False)
    want = reference_run(setup(model, dp, gas, MB, STEPS, LR, CLIP, bf16), STEPS)
    world = dp * pp * options.get("tp", 1)
    results = run_distributed(_train, world, model, pp, schedule, gas, options)
    rel, atol = (1e-2, 4e-3) if bf16 else (1e-5, 1e-6)
    assert max(want["norms"]) > CLIP, f"{name}: clipping never engaged; the test is void"
    assert sorted({r["stage"] for r in results}) == list(range(pp)), name
    for rank, got in enumerate(results):
        tag = f"layout {name} rank {rank} (stage {got['stage']})"
        assert got["losses"] == pytest.approx(want["losses"], rel=rel), tag
        assert got["norms"] == pytest.approx(want["norms"], rel=2 * rel), tag
        assert got["params"].keys() == want["params"].keys(), tag
        for k, w in want["params"].items():
            diff = (got["params"][k] - w.float()).abs().max().item()
            assert diff <= atol, f"{tag}: {k} differs by {diff:.2e} > {atol:.0e}"
