"""shardwise.metrics: sums and means across ranks, exact global ratios with uneven shards."""

import math

import pytest
import torch
from harness import run_distributed

from shardwise import comm
from shardwise.metrics import Accuracy, MeanMetric, all_reduce_mean, all_reduce_sum
from shardwise.topology import new_subgroup

# Rank r holds SHARDS[r] = (correct, total): uneven on purpose, so the mean of per-rank
# accuracies (0.5 * (3/4 + 1/10) = 0.425) differs from the global one (4/14).
SHARDS = [(3, 4), (1, 10)]


def _reductions() -> dict:
    r = comm.get_rank()
    t = torch.tensor([1.0, 2.0]) * (r + 1)
    before = t.clone()
    out = {
        "sum_float": all_reduce_sum(r + 0.5),
        "mean_float": all_reduce_mean(float(r)),
        "sum_tensor": all_reduce_sum(t),
        "mean_int_tensor": all_reduce_mean(torch.tensor([r, 2 * r])),
        "caller_untouched": torch.equal(t, before),
    }
    acc = Accuracy()
    correct, total = SHARDS[r]
    acc.update(torch.tensor(correct), total)  # tensors and numbers mix
    out["accuracy"] = acc.compute()
    out["local"] = acc.local()
    logits_acc = Accuracy()
    logits = torch.eye(3)[[0, 1, 2, 0]]  # predicts 0, 1, 2, 0
    logits_acc.update_logits(logits, torch.tensor([0, 1, 2, r]))  # rank 1 misses one
    out["logits_accuracy"] = logits_acc.compute()
    loss = MeanMetric()
    loss.update(torch.tensor(2.0 * (r + 1)), weight=3 if r == 0 else 1)  # 2.0 x3, 4.0 x1
    out["mean_metric"] = loss.compute()
    out["empty"] = Accuracy().compute()
    return out


def test_reductions_on_two_ranks():
    for r, out in enumerate(run_distributed(_reductions, 2)):
        tag = f"world=2 rank={r}"
        assert out["sum_float"] == 2.0, tag
        assert out["mean_float"] == 0.5, tag
        assert out["sum_tensor"].tolist() == [3.0, 6.0], tag
        assert out["mean_int_tensor"].tolist() == [0.5, 1.0], tag
        assert out["caller_untouched"], tag
        assert out["accuracy"] == pytest.approx(4 / 14, rel=1e-15), f"{tag}: counts not summed"
        assert out["local"] == (float(SHARDS[r][0]), float(SHARDS[r][1])), tag
        assert out["logits_accuracy"] == pytest.approx(7 / 8), tag
        assert out["mean_metric"] == pytest.approx((2.0 * 3 + 4.0) / 4), tag
        assert math.isnan(out["empty"]), tag


def _subgroup_sum() -> tuple[float, float]:
    r = comm.get_rank()
    evens, odds = new_subgroup([0, 2]), new_subgroup([1, 3])  # every rank creates both
    mine = evens if r % 2 == 0 else odds
    acc = Accuracy()
    acc.update(r, 10)
    return all_reduce_sum(float(r), group=mine), acc.compute(group=mine)


def test_group_argument_limits_the_reduction():
    for r, (total, acc) in enumerate(run_distributed(_subgroup_sum, 4)):
        expected = 0 + 2 if r % 2 == 0 else 1 + 3
        assert total == expected, f"world=4 rank={r}: summed outside its subgroup"
        assert acc == pytest.approx(expected / 20), f"world=4 rank={r}"


def test_single_process_is_local():
    comm.reset_stats()
    assert all_reduce_sum(3) == 3.0
    assert all_reduce_mean(torch.tensor([2.0])).tolist() == [2.0]
    acc = Accuracy()
    acc.update(3, 4)
    acc.update(1, 4)
    assert acc.compute() == 0.5
    acc.reset()
    assert math.isnan(acc.compute())
    assert comm.stats() == {}, "a world of one sends nothing"
