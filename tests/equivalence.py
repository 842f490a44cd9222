"""The correctness contract, shared by every layout test.

``setup``: the run of TinyMLP a layout makes, as one_process.reference_run trains it (one
process, plain PyTorch, the whole global batch per step; in 16 bits an fp32 master copy of the
weights kept by hand, the policy the engine follows). ``engine_run``: every rank trains through
``shardwise.initialize`` on its slice of each global batch. Both give losses, gradient norms
and final parameters (fp32, on CPU).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from models import make_data, make_model, rank_slice
from one_process import global_batches, precision
from torch import nn

import shardwise
from shardwise import comm
from shardwise.verify import VerifySetup

STEPS = 6
MB = 4

OPTIMIZERS = {
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    "adamw": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
}


def engine_config(gas: int, clipping: float, opt_name: str, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clipping,
        "optimizer": OPTIMIZERS[opt_name],
        **extra,
    }


def setup(
    dp: int,
    gas: int,
    clipping: float,
    opt_name: str,
    dtype: str = "fp32",
    steps: int = STEPS,
    model: Callable[[], nn.Module] | None = None,
) -> VerifySetup:
    """The run every layout of test_dp / test_zero / test_zero3 makes, for the one-process
    reference: ``model`` (make_model unless given) on MSE, the global batch of B = MB*dp*gas
    rows of make_data per step."""
    rows = MB * dp * gas
    config = engine_config(gas, clipping, opt_name, **precision(dtype))
    return VerifySetup(
        model or make_model, global_batches(make_data, rows, steps), config, F.mse_loss
    )


def engine_run(
    dp: int, gas: int, clipping: float, opt_name: str, steps: int = STEPS, **extra
) -> dict:
    """Each rank trains on its slice of every global batch through the engine."""
    config = engine_config(gas, clipping, opt_name, **extra)
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    rank = engine.dp_rank
    x, y = make_data(MB * dp * gas * steps)
    losses, norms = [], []
    for k in range(steps):
        micro = []
        for j in range(gas):
            rows = rank_slice(k, j, rank, MB, dp, gas)
            out = engine(x[rows])
            loss = F.mse_loss(out, y[rows].to(out.dtype))
            engine.backward(loss)
            engine.step()
            micro.append(loss.detach().float())
        step_loss = torch.stack(micro).mean()
        comm.all_reduce(step_loss, group=engine.mesh.dp_group)
        losses.append(step_loss.item() / dp)
        norms.append(engine.get_global_grad_norm())
    assert engine.global_steps == steps, engine.global_steps
    params = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params, "memory": engine.memory_breakdown()}


def assert_params_match(got: dict, want: dict, opt_name: str, tag: str, atol: float = 2e-6) -> None:
    """SGD: every element within ``atol``. AdamW: 99.9% of elements within 1e-5 and the
    worst within a few lr steps (see test_dp.py for why Adam needs the fraction)."""
    assert got.keys() == want.keys(), tag
    for name, w in want.items():
        diff = (got[name] - w).abs()
        if opt_name == "sgd":
            assert diff.max() <= atol, f"{tag}: {name} differs by {diff.max():.2e} > {atol:.0e}"
        else:
            frac = (diff > max(atol, 1e-5)).float().mean()
            assert frac < 1e-3, f"{tag}: {name}: {frac:.2%} of elements differ by > {atol:.0e}"
            assert diff.max() < 5e-3, f"{tag}: {name} differs by {diff.max():.2e}"


def assert_layout_matches(
    results: list, want: dict, name: str, opt_name: str, dtype: str, clip: float
) -> None:
    """Every rank matches the reference (tolerances per dtype, justified in the test modules),
    clipping really engaged, and all ranks hold identical final parameters."""
    import pytest

    bf16 = dtype == "bf16"
    rel = 1e-2 if bf16 else 1e-5
    for rank, got in enumerate(results):
        tag = f"layout {name} rank {rank}"
        assert got["losses"] == pytest.approx(want["losses"], rel=rel, abs=1e-6), tag
        assert got["norms"] == pytest.approx(want["norms"], rel=rel * 2), tag
        assert_params_match(
            got["params"], want["params"], opt_name, tag, atol=4e-3 if bf16 else 2e-6
        )
    assert max(want["norms"]) > clip, f"{name}: clipping never engaged; the test is void"
    first = results[0]["params"]
    for rank, got in enumerate(results[1:], 1):
        for k in first:
            assert torch.equal(first[k], got["params"][k]), f"{name}: rank {rank} diverged on {k}"
