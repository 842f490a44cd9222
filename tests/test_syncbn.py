"""SyncBatchNorm: every layout of one global batch normalizes like one nn.BatchNorm over it.

Each rank holds a contiguous slice of the batch (sizes may differ, even be 0). Compared with a
single torch batch norm over the full batch: outputs, input grads, the sum over ranks of the
weight/bias grads (each rank holds its share; data parallelism sums them), running statistics
after two steps, and eval outputs.

Tolerances. fp64 runs must agree to 1e-10: same math, only reduction order and the
sum-of-squares variance (ours) versus torch's Welford update differ. fp32 runs: those
differences cost a few ulps per sum over <= 200 elements; inputs have mean 0.5 and std 2, so
the cancellation in S2/M - mean^2 adds only ~eps * mean^2/var ~ 1e-8. Measured: <= 1e-6
absolute on outputs, input grads and running stats (values of order 1), <= 6e-6 relative on the
summed weight grads (sums of up to 200 terms). rtol 2e-5 / atol 2e-6 leaves a margin of ~3x,
while any wrong statistic (a rank's share missing, a biased running var, a missing collective)
errs by > 1e-2.
"""

import pytest
import torch
from harness import run_distributed
from torch import nn

from shardwise import comm
from shardwise.parallel.data.syncbn import (
    SyncBatchNorm,
    _SyncBatchNormFunction,
    convert_sync_batchnorm,
)
from shardwise.topology import new_subgroup

BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}

# (name, per-sample shape (C, *), per-rank batch sizes, dtype): the world size is len(splits).
LAYOUTS = [
    ("2d even", (3, 4, 5), [4, 4], torch.float32),
    ("2d uneven", (3, 4, 5), [1, 6], torch.float32),
    ("2d 4 ranks", (3, 4, 5), [2, 2, 2, 2], torch.float32),
    ("2d 4 ranks uneven, one empty", (3, 4, 5), [0, 3, 1, 4], torch.float32),
    ("1d (N, C)", (5,), [3, 5], torch.float32),
    ("1d (N, C, L)", (2, 7), [1, 2, 3, 2], torch.float32),
    ("3d (N, C, D, H, W)", (2, 3, 2, 3), [2, 1], torch.float32),
    ("2d uneven fp64", (3, 4, 5), [5, 2], torch.float64),
]


def _data(shape, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g, dtype=dtype) * 2 + 0.5
    dy = torch.randn(n, *shape, generator=g, dtype=dtype)
    x2 = torch.randn(n, *shape, generator=g, dtype=dtype) - 1  # a second step, other stats
    c = shape[0]
    wb = torch.randn(2, c, generator=g, dtype=dtype)
    return x, dy, x2, wb


def _run_bn(bn, x, dy, x2):
    """One train step with grads, a second forward, then eval: what the tests compare."""
    x = x.clone().requires_grad_()
    comm.reset_stats()
    y = bn(x)
    y.backward(dy)
    calls = comm.stats().get("all_reduce", {}).get("calls", 0)
    bn(x2)
    bn.eval()
    comm.reset_stats()
    with torch.no_grad():
        y_eval = bn(x2)
    eval_comm = comm.stats()
    bn.train()
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw": bn.weight.grad,
        "db": bn.bias.grad,
        "rm": bn.running_mean.clone(),
        "rv": bn.running_var.clone(),
        "nbt": int(bn.num_batches_tracked),
        "y_eval": y_eval,
        "all_reduce_calls": calls,
        "eval_comm": eval_comm,
    }


def _rank_step(shape, splits, dtype, seed, pairs=False):
    """On each rank: its slice of the batch through a converted nn.BatchNorm."""
    rank = comm.get_rank()
    group = None
    if pairs:  # two subgroups {0, 1} and {2, 3}, each normalizing its own batch
        groups = [new_subgroup([0, 1]), new_subgroup([2, 3])]
        group, seed, rank = groups[rank // 2], seed + rank // 2, rank % 2
    x, dy, x2, wb = _data(shape, sum(splits), dtype, seed)
    lo, hi = sum(splits[:rank]), sum(splits[: rank + 1])
    bn = BN[len(shape) + 1](shape[0], dtype=dtype)
    with torch.no_grad():
        bn.weight.copy_(wb[0])
        bn.bias.copy_(wb[1])
    bn = convert_sync_batchnorm(bn, process_group=group)
    assert isinstance(bn, SyncBatchNorm)
    return _run_bn(bn, x[lo:hi], dy[lo:hi], x2[lo:hi])


def _reference(shape, splits, dtype, seed):
    x, dy, x2, wb = _data(shape, sum(splits), dtype, seed)
    bn = BN[len(shape) + 1](shape[0], dtype=dtype)
    with torch.no_grad():
        bn.weight.copy_(wb[0])
        bn.bias.copy_(wb[1])
    return _run_bn(bn, x, dy, x2)


def _compare(results, ref, tag, dtype):
    tol = TOL[dtype]
    cat = {k: torch.cat([r[k] for r in results]) for k in ("y", "dx", "y_eval")}
    for k in ("y", "dx", "y_eval"):
        torch.testing.assert_close(cat[k], ref[k], **tol, msg=lambda m, k=k: f"{tag}: {k}: {m}")
    for k in ("dw", "db"):
        total = sum(r[k] for r in results)
        torch.testing.assert_close(total, ref[k], **tol, msg=lambda m, k=k: f"{tag}: {k}: {m}")
    for r, out in enumerate(results):
        for k in ("rm", "rv"):
            torch.testing.assert_close(
                out[k], ref[k], **tol, msg=lambda m, k=k, r=r: f"{tag} rank {r}: {k}: {m}"
            )
        assert out["nbt"] == ref["nbt"] == 2, tag
        assert out["all_reduce_calls"] == 2, f"{tag} rank {r}: one collective each way"
        assert out["eval_comm"] == {}, f"{tag} rank {r}: eval must not communicate"


@pytest.mark.parametrize("name,shape,splits,dtype", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_matches_one_batchnorm_over_the_global_batch(name, shape, splits, dtype):
    tag = f"{name}: world={len(splits)} splits={splits} {dtype}"
    results = run_distributed(_rank_step, len(splits), shape, splits, dtype, 0)
    _compare(results, _reference(shape, splits, dtype, 0), tag, dtype)


def test_process_group_argument_normalizes_within_the_subgroup():
    shape, splits, dtype = (3, 4, 4), [2, 3], torch.float32
    results = run_distributed(_rank_step, 4, shape, splits, dtype, 10, pairs=True)
    for pair in (0, 1):
        tag = f"subgroup {{{2 * pair}, {2 * pair + 1}}} of world=4 splits={splits}"
        ref = _reference(shape, splits, dtype, 10 + pair)
        _compare(results[2 * pair : 2 * pair + 2], ref, tag, dtype)


def test_function_gradients_match_finite_differences():
    """Single process (the collectives are no-ops): the backward formula itself, in fp64."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: _SyncBatchNormFunction.apply(x, w, b, 1e-5, None)[0], (x, w, b)
    )
    assert torch.autograd.gradcheck(
        lambda x: _SyncBatchNormFunction.apply(x, None, None, 1e-5, None)[0], (x,)
    )


def test_convert_shares_parameters_and_keeps_state():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.BatchNorm1d(6, momentum=None)),
    )
    model[2][2].weight.requires_grad_(False)
    x = torch.randn(8, 1, 6, 6)
    model(x)  # running statistics away from their initial values
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[1].weight
    model[1].eval()
    converted = convert_sync_batchnorm(model)
    assert converted is model
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[2][2], SyncBatchNorm)
    assert model[1].weight is weight, "parameters must be shared, not copied"
    assert not model[2][2].weight.requires_grad and model[2][2].momentum is None
    assert not model[1].training, "eval mode must survive the conversion"
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref_state[k]), f"state {k} changed"
    lone = convert_sync_batchnorm(nn.BatchNorm3d(2))
    assert isinstance(lone, SyncBatchNorm)


def test_single_process_equals_torch_batchnorm():
    """A group of one runs torch's own kernel: bit-identical to nn.BatchNorm2d."""
    torch.manual_seed(0)
    ref, ours = nn.BatchNorm2d(3), SyncBatchNorm(3)
    x = torch.randn(4, 3, 5, 5)
    for mode in ("train", "eval"):
        getattr(ref, mode)()
        getattr(ours, mode)()
        assert torch.equal(ref(x), ours(x)), mode
    assert torch.equal(ref.running_var, ours.running_var)
    with pytest.raises(ValueError, match="expects input"):
        ours(torch.randn(3))
