"""fp16 with dynamic loss scaling trains like one fp16 process, overflow for overflow.

The reference keeps fp16 weights, an fp32 master copy and DeepSpeed's dynamic loss scaler by
hand (``shardwise.precision.LossScaler`` is tested separately against papers.md section 7).
An infinite gradient is injected on ONE rank at chosen steps: every rank must skip those
steps, lower the scale, not step the scheduler, and count them.

Tolerance: fp16 has 10 mantissa bits (relative step 2^-10 ~ 1e-3); per-rank gradients are
rounded to fp16 before the cross-rank sum, so parameters (|w| < 0.5) may differ by one fp16 ulp
(~5e-4) and losses by ~1e-3 relative. We allow 2e-3 and 5e-3; the overflow pattern and the
loss scale must match exactly.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from equivalence import MB
from harness import run_distributed
from models import make_data, make_model, rank_slice

import shardwise
from shardwise import comm
from shardwise.lr_formulas import WarmupLR
from shardwise.precision import LossScaler

STEPS = 8
INJECT = {2, 3}  # steps whose gradient is made infinite on rank INJECT_RANK
INJECT_RANK = 1
FP16 = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 8,
    "hysteresis": 1,
    "loss_scale_window": 3,
    "min_loss_scale": 1,
}
SGD = {"type": "SGD", "params": {"lr": 0.05}}
SCHED = {
    "type": "WarmupLR",
    "params": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.05,
        "warmup_num_steps": 4,
        "warmup_type": "linear",
    },
}


def _poison(step_box: list, rank: int):
    def hook(grad):
        if step_box[0] in INJECT and rank == INJECT_RANK:
            return grad * math.inf
        return grad

    return hook


def reference_fp16(dp: int) -> dict:
    model = make_model().half()
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=0.05)
    sched = WarmupLR(
        opt, warmup_min_lr=0.0, warmup_max_lr=0.05, warmup_num_steps=4, warmup_type="linear"
    )
    scaler = LossScaler(init_scale=2**8, dynamic=True, scale_window=3, hysteresis=1)
    batch = MB * dp
    x, y = make_data(batch * STEPS)
    step_box = [0]
    model.head.weight.register_hook(_poison(step_box, INJECT_RANK))
    out = {"losses": [], "scales": [], "skipped": 0, "lrs": []}
    for k in range(STEPS):
        step_box[0] = k
        rows = slice(k * batch, (k + 1) * batch)
        loss = F.mse_loss(model(x[rows].half()), y[rows].half())
        (loss * scaler.scale).backward()
        grads = [p.grad.float() / scaler.scale for p in model.parameters()]
        overflow = not all(torch.isfinite(g).all() for g in grads)
        if overflow:
            out["skipped"] += 1
        else:
            for m, g in zip(masters, grads, strict=True):
                m.grad = g
            opt.step()
            sched.step()
            with torch.no_grad():
                for m, p in zip(masters, model.parameters(), strict=True):
                    p.copy_(m)
        model.zero_grad(set_to_none=True)
        scaler.update(overflow)
        out["losses"].append(loss.item())
        out["scales"].append(scaler.scale)
        out["lrs"].append(opt.param_groups[0]["lr"])
    out["params"] = {k: v.float() for k, v in model.state_dict().items()}
    return out


def engine_fp16(dp: int, stage: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": SGD,
        "scheduler": SCHED,
        "fp16": FP16,
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    rank = engine.dp_rank
    step_box = [0]
    engine.module.head.weight.register_hook(_poison(step_box, rank))
    x, y = make_data(MB * dp * STEPS)
    out = {"losses": [], "scales": [], "applied": [], "lrs": []}
    for k in range(STEPS):
        step_box[0] = k
        rows = rank_slice(k, 0, rank, MB, dp, 1)
        loss = F.mse_loss(engine(x[rows]), y[rows].half())
        engine.backward(loss)
        engine.step()
        total = loss.detach().float()
        comm.all_reduce(total, group=engine.mesh.dp_group)
        out["losses"].append(total.item() / dp)
        out["scales"].append(engine.scaler.scale)
        out["applied"].append(engine.was_step_applied())
        out["lrs"].append(engine.get_lr()[0])
    out.update(skipped=engine.skipped_steps, global_steps=engine.global_steps)
    out["params"] = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return out


@pytest.mark.parametrize("dp,stage", [(2, 0), (2, 1), (2, 2), (4, 2)])
def test_overflow_on_one_rank_skips_the_step_everywhere(dp, stage):
    want = reference_fp16(dp)
    assert want["skipped"] >= len(INJECT), "the injected overflows must be seen"
    for rank, got in enumerate(run_distributed(engine_fp16, dp, dp, stage)):
        tag = f"fp16 dp{dp} stage{stage} rank {rank}"
        applied = [k not in INJECT for k in range(STEPS)]
        assert got["applied"] == applied, f"{tag}: step applied {got['applied']}"
        assert got["skipped"] == want["skipped"] and got["global_steps"] == STEPS, tag
        assert got["scales"] == want["scales"], f"{tag}: loss scales {got['scales']}"
        assert got["lrs"] == pytest.approx(want["lrs"]), (
            f"{tag}: the scheduler must not step on overflow"
        )
        assert got["losses"] == pytest.approx(want["losses"], rel=5e-3, nan_ok=True), tag
        for k, w in want["params"].items():
            diff = (got["params"][k] - w).abs().max()
            assert diff <= 2e-3, f"{tag}: {k} differs by {diff:.2e}"
