"""The engine with the backward split into B and W trains exactly as with the fused backward.

Each row trains twice in one world, from the same weights on the same batches: 1F1B as is,
then 1F1B with every backward run as B then W (zero_bubble.split_backward, patched into the
runner). The split changes no product (tests/test_pipe_split_backward.py) and, in this order,
no sum: every parameter still gets its micro-batches' gradients in the same order. So losses,
norms and parameters must be equal bit for bit, except under ZeRO-2: it reduce-scatters what
each B and each W added (non-linear and linear parameters' gradients in separate
reductions), so its shard sums a micro-batch's gradient in two additions instead of one,
rounding differently by about one ulp per step: 1e-6 relative there.
"""

import pytest
import torch
from harness import run_distributed
from pipe_models import micro_batches, pipeline_module

import shardwise
from shardwise.parallel.pipeline import train_batch
from shardwise.parallel.pipeline.instructions import Op
from shardwise.parallel.pipeline.zero_bubble import split_backward

STEPS, MB, GAS = 3, 2, 4

ROWS = [  # (name, model, dp, pp, options)
    ("pp2-mlp", "mlp", 1, 2, {}),
    ("pp2-tied-lm", "lm", 1, 2, {}),
    ("pp2-ckpt", "mlp", 1, 2, {"activation_checkpoint_interval": 1}),
    ("dp2-pp2-zero1", "mlp", 2, 2, {"zero": 1}),
    ("dp2-pp2-zero2", "mlp", 2, 2, {"zero": 2}),
    ("dp2-pp2-plain-tied", "lm", 2, 2, {}),
]


def _run(model, pp, options, split):
    options = dict(options)
    zero = options.pop("zero", 0)
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "pipeline": {"schedule": "1f1b"},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 300},
    }
    original = train_batch.make_schedule
    if split:
        train_batch.make_schedule = lambda *a: split_backward(original(*a))
    try:
        engine, *_ = shardwise.initialize(
            model=pipeline_module(model, pp, **options), config=config
        )
        data = micro_batches(model, engine, MB, GAS, STEPS)
        reads = engine.is_first_stage() or engine.is_last_stage()
        losses = [engine.train_batch(data if reads else None).item() for _ in range(STEPS)]
        program = train_batch.make_schedule("1f1b", pp, engine.pipeline.stage_id, GAS)
    finally:
        train_batch.make_schedule = original
    ops = {ins.op for ins in program}
    assert (Op.BACKWARD_WEIGHT in ops) == split and (Op.BACKWARD in ops) != split
    return losses, engine.get_global_grad_norm(), engine.consolidated_state_dict()


def _both(model, pp, options):
    return _run(model, pp, options, False), _run(model, pp, options, True)


@pytest.mark.parametrize("name,model,dp,pp,options", ROWS, ids=[r[0] for r in ROWS])
def test_split_backward_trains_like_the_fused_one(name, model, dp, pp, options):
    exact = options.get("zero") != 2
    for rank, (fused, split) in enumerate(run_distributed(_both, dp * pp, model, pp, options)):
        tag = f"layout {name} rank {rank}"
        if exact:
            assert split[0] == fused[0] and split[1] == fused[1], tag
        else:
            assert split[0] == pytest.approx(fused[0], rel=1e-6), tag
        for k, w in fused[2].items():
            diff = (split[2][k] - w).abs().max().item()
            assert diff == 0 if exact else diff <= 1e-6, f"{tag}: {k} differs by {diff:.1e}"
        assert not torch.equal(fused[2][k], pipeline_module(model, 1).state_dict()[k]), tag


class Scale(torch.nn.Module):
    """y = x * s elementwise: trainable, but no linear, so nothing for a W to do."""

    def __init__(self, width):
        super().__init__()
        self.s = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x * self.s


def _no_linear_stage(schedule):
    from shardwise.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    layers = [LayerSpec(torch.nn.Linear, 16, 4), torch.nn.Tanh(), LayerSpec(Scale, 4)]
    module = PipelineModule(
        layers, num_stages=2, loss_fn=torch.nn.functional.mse_loss, partition_method="uniform"
    )
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "pipeline": {"schedule": schedule},
    }
    engine, *_ = shardwise.initialize(model=module, config=config)
    data = micro_batches("mlp", engine, MB, GAS, STEPS)
    losses = [engine.train_batch(data).item() for _ in range(STEPS)]
    return losses, engine.pipeline.executor.splits, engine.consolidated_state_dict()


def _zb_and_1f1b():
    return _no_linear_stage("zb-h1"), _no_linear_stage("1f1b")


def test_a_stage_without_linears_runs_fused_backwards_and_says_so():
    """Stage 1 holds only Scale: its first zb-h1 batch finds nothing for W (splits False) and
    the runner writes its later programs with full backwards; stage 0 splits. Trained, it is
    1F1B bit for bit (same products, each parameter's micro-batches summed in the same order)."""
    for rank, (zb, ofob) in enumerate(run_distributed(_zb_and_1f1b, 2)):
        assert zb[1] is (rank == 0), f"rank {rank}: splits {zb[1]}"
        assert ofob[1] is None, "1F1B never splits"
        assert zb[0] == ofob[0], f"rank {rank}"
        for k, v in ofob[2].items():
            assert torch.equal(zb[2][k], v), k
