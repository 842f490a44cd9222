"""Verify's tolerance for optimizers that divide by the root of a running sum of squares
(Adagrad, RMSprop) and for 16-bit training: the bounds noise.py and compare.py derive, and the
draws of ``verify --fuzz`` under ZeRO-3 that the older bounds called mismatches."""

from __future__ import annotations

import pytest
import torch

from shardwise.verify.compare import compare, tolerance_for
from shardwise.verify.noise import noise_move, noise_share
from shardwise.verify.results import RunResult

BF16 = {"bf16": {"enabled": True}}


def _opt(kind: str, **params) -> dict:
    return {"optimizer": {"type": kind, "params": params}}


@pytest.mark.parametrize(
    "name, config, steps, want",
    [
        ("Adagrad default lr 1e-2, 1 step: sign flip 2 lr", _opt("Adagrad"), 1, 2e-2),
        ("Adagrad, 3 steps", _opt("Adagrad"), 3, 6e-2),
        ("Adagrad lr 1e-3", _opt("Adagrad", lr=1e-3), 3, 6e-3),
        ("RMSprop: gain 1/sqrt(1-0.99) = 10", _opt("RMSprop"), 1, 0.2),
        ("RMSprop alpha 0.75: gain 2", _opt("RMSprop", alpha=0.75, lr=1e-2), 1, 4e-2),
        ("RMSprop momentum 0.5: gain / (1-m)", _opt("RMSprop", momentum=0.5), 1, 0.4),
        ("RMSprop centered: no bound derived", _opt("RMSprop", centered=True), 1, 0.0),
        ("Adam keeps compare.py's caps", _opt("Adam"), 3, 0.0),
        ("SGD does not normalize", _opt("SGD", lr=0.1), 3, 0.0),
        (
            "WarmupLR's default peak 1e-3 under lr 1e-2: lr",
            {**_opt("Adagrad"), "scheduler": {"type": "WarmupLR", "params": {}}},
            1,
            2e-2,
        ),
        (
            "WarmupLR's peak above the optimizer's lr",
            {**_opt("Adagrad", lr=1e-4), "scheduler": {"type": "WarmupLR", "params": {}}},
            1,
            2e-3,
        ),
        (
            "OneCycle's cycle_max_lr",
            {
                **_opt("Adagrad", lr=1e-4),
                "scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1e-3}},
            },  # fmt: skip
            2,
            4e-3,
        ),
    ],
)
def test_the_noise_move_is_two_steps_times_gain_times_peak_lr(name, config, steps, want):
    assert noise_move(config, steps) == pytest.approx(want), name


def _run(w: torch.Tensor, step: int) -> RunResult:
    """A run whose parameter ``w`` is zero until ``step`` and ``w`` from then on."""
    params = [{"w": w if s >= step else torch.zeros_like(w)} for s in range(1, 4)]
    return RunResult("l", [1.0] * 3, [2.0] * 3, ["w"], params)


def _flipped(n: int, count: int, by: float) -> torch.Tensor:
    w = torch.zeros(n)
    w[:count] = by
    return w


# Each row: a config, the tensor of the layout after `step` (the reference's is zero), and
# whether verify must call it diverged. The "fuzz" rows are the ZeRO-3 draws found mismatched
# before this bound (3 steps each); they diverged under the old bounds.
CASES = [
    # seed 10 case 4 (cp4 hpz2 offload_param) and its dp4 zero0 twin: Adagrad's first step
    # lr sign(g) flipped on 4 of 1024 elements whose bf16 gradient is below its rounding.
    ("fuzz 10/4: bf16 Adagrad, 4 of 1024 by 2 lr", {**BF16, **_opt("Adagrad")}, 1, _flipped(1024, 4, 2e-2), False),
    # seed 7 case 15 (dp4 hpz2): one element of a 32-element LayerNorm weight at step 2.
    ("fuzz 7/15: bf16 Adagrad, 1 of 32 by 7.8e-3", {**BF16, **_opt("Adagrad")}, 2, _flipped(32, 1, 7.8e-3), False),
    # RMSprop's first step is 10 lr sign(g): one flipped element moves 0.2, far past fp32's cap.
    ("RMSprop fp32: 1 of 1024 flipped by 0.2", _opt("RMSprop"), 1, _flipped(1024, 1, 0.2), False),
    # What a wrong layout does is still caught:
    ("bf16 Adagrad: 10% of a tensor moved", {**BF16, **_opt("Adagrad")}, 1, _flipped(1024, 102, 2e-2), True),
    ("bf16 Adagrad: one element past 2 N lr", {**BF16, **_opt("Adagrad")}, 1, _flipped(1024, 1, 7e-2), True),
    # seed 15 case 2 (tiny Llama, dp4 ZeRO-3 hpz2, fp32): RMSprop's gain lr 0.1 amplifies
    # fp32 reduction-order errors on the elements whose gradient nearly cancels.
    ("fuzz 15/2: fp32 RMSprop, 5 of 2048 by 9.3e-5", _opt("RMSprop"), 2, _flipped(2048, 5, 9.3e-5), False),
    ("RMSprop fp32: 30% of a tensor flipped", _opt("RMSprop"), 1, _flipped(1024, 307, 0.2), True),
    ("Adagrad fp32: 3% of a tensor moved", _opt("Adagrad"), 1, _flipped(1024, 31, 1e-3), True),
    ("bf16 Adam: one element past the cap", {**BF16, **_opt("Adam")}, 1, _flipped(1024, 1, 6e-2), True),
    ("bf16 SGD: a 3-element bias, one moved", {**BF16, **_opt("SGD")}, 1, _flipped(3, 1, 1e-2), True),
]  # fmt: skip


@pytest.mark.parametrize("name, config, step, w, diverged", CASES)
def test_noise_a_correct_layout_makes_passes_and_a_bug_does_not(name, config, step, w, diverged):
    want = _run(torch.zeros_like(w), 1)
    v = compare(_run(w, step), want, tolerance_for(config, 3), 2)
    assert v.diverged == diverged, f"{name}: {v.findings}"


@pytest.mark.parametrize(
    "name, got, want, diverged",
    [
        # seed 10 case 4 (cp4 in bf16, with and without ZeRO-3): step 1, before any update
        ("fuzz 10/4: 4.5625 vs 4.5 (3.6u)", 4.5625, 4.5, False),
        ("4 ulps at 4.5 (7.1u): beyond 5u", 4.625, 4.5, True),
    ],
)
def test_a_bf16_loss_is_bound_by_its_own_roundings(name, got, want, diverged):
    ref = RunResult("ref", [want], [2.0], ["w"], [{"w": torch.zeros(4)}])
    run = RunResult("l", [got], [2.0], ["w"], [{"w": torch.zeros(4)}])
    v = compare(run, ref, tolerance_for(BF16, 1), 2)
    assert v.diverged == diverged, f"{name}: {v.findings}"


def test_the_loss_of_split_tokens_differs_by_its_roundings_within_5u():
    """compare.py's 4u from the two roundings of each loss (the logits the same here)."""
    import torch.nn.functional as F

    tol, gen, worst = tolerance_for(BF16, 1), torch.Generator().manual_seed(0), 0.0
    for _ in range(300):
        z = (torch.randn(32, 65, generator=gen) * 0.5).bfloat16()  # 32 tokens, 65 classes
        y = torch.randint(65, (32,), generator=gen)
        one = float(F.cross_entropy(z, y))
        parts = sum(float(F.cross_entropy(z[i : i + 8], y[i : i + 8])) for i in range(0, 32, 8))
        worst = max(worst, abs(parts / 4 - one) / one)
    assert worst <= 4 * 2**-8 <= tol.loss_rel, f"split loss {worst / 2**-8:.2f}u beyond 4u"


@pytest.mark.parametrize(
    "name, config, want",
    [
        ("RMSprop defaults: gain lr 0.1, 100x Adam's 1e-3", _opt("RMSprop"), 0.1),
        ("Adagrad defaults: gain lr 1e-2", _opt("Adagrad"), 1e-2),
        ("Adagrad at Adam's lr: Adam's share", _opt("Adagrad", lr=1e-3), 1e-3),
        ("Adam: compare.py's own share", _opt("Adam"), 0.0),
    ],
)
def test_the_share_grows_with_gain_times_lr(name, config, want):
    assert noise_share(config, 3) == pytest.approx(want), name
