"""The correctness contract, shared by every layout test.

``reference_run``: one process, plain PyTorch (no shardwise), the whole global batch per step;
in 16 bits it keeps an fp32 master copy of the weights by hand, the policy the engine follows.
``engine_run``: every rank trains through ``shardwise.initialize`` on its slice of each global
batch. Both return losses, gradient norms and final parameters (fp32, on CPU).
"""

import torch
import torch.nn.functional as F
from models import make_data, make_model, rank_slice

import shardwise
from shardwise import comm

STEPS = 6
MB = 4

OPTIMIZERS = {
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    "adamw": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _torch_optimizer(name: str, params):
    spec = OPTIMIZERS[name]["params"]
    cls = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    return cls(params, **spec)


def reference_run(
    dp: int, gas: int, clipping: float, opt_name: str, dtype: str = "fp32", steps: int = STEPS
) -> dict:
    """One process, the whole global batch of B = MB*dp*gas rows per step."""
    model = make_model().to(DTYPES[dtype])
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = _torch_optimizer(opt_name, masters)
    batch = MB * dp * gas
    x, y = make_data(batch * steps)
    losses, norms = [], []
    for k in range(steps):
        rows = slice(k * batch, (k + 1) * batch)
        loss = F.mse_loss(model(x[rows].to(DTYPES[dtype])), y[rows].to(DTYPES[dtype]))
        loss.backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad = p.grad.float()
            p.grad = None
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, clipping or 1e9)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
        losses.append(loss.item())
    params = {k: v.float() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params}


def engine_config(gas: int, clipping: float, opt_name: str, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clipping,
        "optimizer": OPTIMIZERS[opt_name],
        **extra,
    }


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
