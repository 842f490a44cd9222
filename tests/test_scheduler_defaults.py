"""DeepSpeed's schedulers have DeepSpeed 0.19's defaults and give DeepSpeed's lr sequences.

Every row names DeepSpeed 0.19.8's value; all come from deepspeed/runtime/lr_schedules.py (the
constructors' signatures of ``LRRangeTest``, ``OneCycle``, ``WarmupLR``, ``WarmupDecayLR`` and
``WarmupCosineLR``; ``warmup_max_lr=None`` there means "the optimizer's lr of each group"). The
sequences are compared with DeepSpeed's formulas written out below (``ds_*``), the lr before
the first ``step()`` included (iteration -1): that lr is what the first optimizer step uses,
since DeepSpeed's engine steps the scheduler after the optimizer. Where shardwise differs on
purpose the row says so and the construction warns (docs/config.md says why).
"""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch

from shardwise.config import DeepSpeedDifferenceWarning, SchedulerConfig
from shardwise.lr_schedules import build_scheduler
from shardwise.runtime.lr_schedules import (  # DeepSpeed's path: deepspeed.runtime.lr_schedules
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")

OPTIMIZER_LR = 0.01  # the optimizer's own lr in every case below: unlike any scheduler default

# (scheduler, key, DeepSpeed 0.19.8's default); "optimizer lr": None, each group's lr.
# fmt: off
DEFAULTS = [
    (WarmupLR, "warmup_min_lr", 0.0),
    (WarmupLR, "warmup_max_lr", "optimizer lr"),
    (WarmupLR, "warmup_num_steps", 1000),
    (WarmupLR, "warmup_type", "log"),
    (WarmupLR, "last_batch_iteration", -1),
    (WarmupDecayLR, "warmup_min_lr", 0.0),
    (WarmupDecayLR, "warmup_max_lr", 0.001),  # not the optimizer's lr (fixed here; was None)
    (WarmupDecayLR, "warmup_num_steps", 1000),
    (WarmupDecayLR, "warmup_type", "log"),
    (WarmupDecayLR, "last_batch_iteration", -1),
    (WarmupCosineLR, "warmup_min_ratio", 0.0),
    (WarmupCosineLR, "warmup_num_steps", 1000),
    (WarmupCosineLR, "cos_min_ratio", 0.0001),
    (WarmupCosineLR, "warmup_type", "log"),
    (WarmupCosineLR, "last_batch_iteration", -1),
    (OneCycle, "decay_lr_rate", 0.0),
    (OneCycle, "cycle_first_step_size", 2000),
    (OneCycle, "cycle_second_step_size", None),  # None: the first step size
    (OneCycle, "cycle_first_stair_count", 0),
    (OneCycle, "cycle_second_stair_count", None),  # None: the first stair count
    (OneCycle, "decay_step_size", 0),
    (OneCycle, "cycle_momentum", True),
    (OneCycle, "cycle_min_mom", 0.8),
    (OneCycle, "cycle_max_mom", 0.9),
    (OneCycle, "decay_mom_rate", 0.0),
    (OneCycle, "last_batch_iteration", -1),
    (LRRangeTest, "lr_range_test_min_lr", 1e-3),
    (LRRangeTest, "lr_range_test_step_size", 2000),
    (LRRangeTest, "lr_range_test_step_rate", 1.0),
    (LRRangeTest, "lr_range_test_staircase", False),
    (LRRangeTest, "last_batch_iteration", -1),
]
REQUIRED = {  # keys without a default, in DeepSpeed as here
    WarmupLR: set(), WarmupDecayLR: {"total_num_steps"}, WarmupCosineLR: {"total_num_steps"},
    OneCycle: {"cycle_min_lr", "cycle_max_lr"}, LRRangeTest: set(),
}
# fmt: on


def _params(cls) -> dict[str, inspect.Parameter]:
    return dict(list(inspect.signature(cls.__init__).parameters.items())[2:])


@pytest.mark.parametrize("cls, key, value", DEFAULTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_scheduler_defaults_are_deepspeeds(cls, key, value):
    default = _params(cls)[key].default
    want = None if value == "optimizer lr" else value
    assert default == want and type(default) is type(want), (
        f"{cls.__name__}.{key} defaults to {default!r}, DeepSpeed 0.19's is {value!r}"
    )


@pytest.mark.parametrize("cls", list(REQUIRED), ids=lambda c: c.__name__)
def test_every_key_is_in_the_table_and_the_required_ones_are_deepspeeds(cls):
    params = _params(cls)
    required = {k for k, p in params.items() if p.default is p.empty}
    assert required == REQUIRED[cls], f"{cls.__name__}: required {sorted(required)}"
    pinned = {key for c, key, _ in DEFAULTS if c is cls}
    assert set(params) - required == pinned, f"{cls.__name__}: keys without a row"


def sgd(lr: float = OPTIMIZER_LR) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def adam(lr: float = OPTIMIZER_LR) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr, betas=(0.9, 0.999))


# --- DeepSpeed's formulas, lr at iteration ``it`` (-1: before the first step) ---------------------


def ds_gamma(it: int, w: int, kind: str) -> float:
    """Warmup fraction: ln(it + 1)/ln(W) or it/W while it < W, else 1 (W = max(2, steps))."""
    w = max(2, w)
    if it >= w:
        return 1.0
    return math.log(it + 1) / math.log(w) if kind == "log" else it / w


def ds_warmup(it, lo=0.0, hi=OPTIMIZER_LR, w=1000, kind="log"):
    return lo if it < 0 else lo + (hi - lo) * ds_gamma(it, w, kind)


def ds_warmup_decay(it, t, lo=0.0, hi=0.001, w=1000, kind="log"):
    if it < 0:
        return lo
    if it < max(2, w):
        return lo + (hi - lo) * ds_gamma(it, w, kind)
    return lo + (hi - lo) * max(0.0, (t - it) / max(1, t - max(2, w)))


def ds_cosine(it, t, base=OPTIMIZER_LR, wmin=0.0, w=1000, cmin=1e-4, kind="log"):
    if it < 0:
        return 0.0  # DeepSpeed: 0 before the first step, whatever warmup_min_ratio
    w = max(2, w)
    if it < w:
        return base * (wmin + (1 - wmin) * ds_gamma(it, w, kind))
    p = min(1.0, (it - w + 1) / max(1, t - w))
    return base * max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * p)) / 2)


def ds_one_cycle_scale(it, s1, s2):
    """Height in the cycle: x = (it + 1)/(s1 + s2) mod 1; x/r up to r = s1/(s1 + s2), then down."""
    x = ((it + 1) / (s1 + s2)) % 1.0
    r = s1 / (s1 + s2)
    return x / r if x <= r else (x - 1) / (r - 1)


def ds_one_cycle(it, lo, hi, s1=2000, s2=None, rate=0.0, size=0):
    s2 = s1 if s2 is None else s2
    if it < s1 + s2:
        return lo + (hi - lo) * ds_one_cycle_scale(it, s1, s2)
    if rate == 0 or size == 0:
        return lo
    return lo / (1 + rate * (it - (s1 + s2) + 1) / size)


def ds_one_cycle_mom(it, s1, s2=None, lo=0.8, hi=0.9):
    """beta1 opposite to the lr; after the cycle cycle_max_mom (decay_mom_rate 0: no decay)."""
    s2 = s1 if s2 is None else s2
    return hi - (hi - lo) * ds_one_cycle_scale(it, s1, s2) if it < s1 + s2 else hi


def ds_range(it, lo=1e-3, size=2000, rate=1.0, stairs=False):
    n = (it + 1) / size
    return lo * (1 + rate * (math.floor(n) if stairs else n))


ITS = list(range(-1, 9))  # the lr before the first step, then after 1..9 steps
# name -> (build the scheduler, DeepSpeed's lr at it); each with an optimizer lr of 0.01
# fmt: off
SEQUENCES = {
    "WarmupLR defaults (max: the optimizer's lr)": (lambda o: WarmupLR(o), ds_warmup),
    "WarmupLR linear W=4 min=1e-3 max=0.1": (
        lambda o: WarmupLR(o, 1e-3, 0.1, 4, "linear"), lambda it: ds_warmup(it, 1e-3, 0.1, 4, "linear")),
    "WarmupDecayLR T=6 defaults (max 0.001)": (
        lambda o: WarmupDecayLR(o, 6), lambda it: ds_warmup_decay(it, 6)),
    "WarmupDecayLR T=7 W=4 log": (
        lambda o: WarmupDecayLR(o, 7, warmup_num_steps=4), lambda it: ds_warmup_decay(it, 7, w=4)),
    "WarmupDecayLR T=8 W=3 linear max=0.05": (
        lambda o: WarmupDecayLR(o, 8, 0.0, 0.05, 3, "linear"),
        lambda it: ds_warmup_decay(it, 8, 0.0, 0.05, 3, "linear")),
    "WarmupCosineLR T=6 W=3": (
        lambda o: WarmupCosineLR(o, 6, warmup_num_steps=3), lambda it: ds_cosine(it, 6, w=3)),
    "WarmupCosineLR T=7 W=2 cmin=0.1 linear": (
        lambda o: WarmupCosineLR(o, 7, 0.0, 2, 0.1, "linear"),
        lambda it: ds_cosine(it, 7, w=2, cmin=0.1, kind="linear")),
    "OneCycle 0.01..0.1 step 3": (
        lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=3),
        lambda it: ds_one_cycle(it, 0.01, 0.1, 3)),
    "OneCycle 0.01..0.1 steps 2+3 decay": (
        lambda o: OneCycle(o, 0.01, 0.1, 0.5, 2, 3, decay_step_size=2),
        lambda it: ds_one_cycle(it, 0.01, 0.1, 2, 3, 0.5, 2)),
    "LRRangeTest step 2": (
        lambda o: LRRangeTest(o, lr_range_test_step_size=2), lambda it: ds_range(it, size=2)),
    "LRRangeTest step 3 rate 2 staircase": (
        lambda o: LRRangeTest(o, 1e-3, 3, 2.0, True), lambda it: ds_range(it, 1e-3, 3, 2.0, True)),
}
# fmt: on


@pytest.mark.parametrize("case", list(SEQUENCES))
def test_lr_sequence_is_deepspeeds(case):
    build, want = SEQUENCES[case]
    optimizer = sgd()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedDifferenceWarning)
        scheduler = build(optimizer)
    got = []
    for _ in ITS:
        got.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    # Same formulas in float64, only the order of operations may differ: a few ulps.
    assert got == pytest.approx([want(it) for it in ITS], rel=1e-12, abs=1e-15), case


@pytest.mark.parametrize("s1, s2", [(3, None), (2, 3)])
def test_one_cycle_beta1_is_deepspeeds_after_the_first_step(s1, s2):
    optimizer = adam()
    with pytest.warns(DeepSpeedDifferenceWarning, match="beta1 starts at cycle_max_mom"):
        scheduler = OneCycle(
            optimizer, 0.01, 0.1, cycle_first_step_size=s1, cycle_second_step_size=s2
        )
    got = []
    for _ in ITS[1:]:
        scheduler.step()
        got.append(optimizer.param_groups[0]["betas"][0])
    want = [ds_one_cycle_mom(it, s1, s2) for it in ITS[1:]]
    assert got == pytest.approx(want, rel=1e-12), f"steps {s1}+{s2}"


def test_the_reported_case_warmup_decay_peaks_at_deepspeeds_0_001_not_the_optimizer_lr():
    """Issue 23: WarmupDecayLR without warmup_max_lr peaked at the optimizer's 0.01 (10x)."""
    block = SchedulerConfig("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5})
    optimizer = sgd()
    scheduler = build_scheduler(block, optimizer)
    peak = max(lr_at(scheduler, optimizer, it) for it in range(20))
    assert peak == pytest.approx(0.001, rel=1e-12), f"peak {peak}, DeepSpeed's 0.001"
    warmup = WarmupLR(sgd())
    assert warmup.max_lrs == [OPTIMIZER_LR], (
        "WarmupLR's max stays the optimizer's lr, as DeepSpeed's"
    )


def lr_at(scheduler, optimizer, it):
    scheduler.step(it)
    return optimizer.param_groups[0]["lr"]


# (case, build, shardwise's lr before the first step, DeepSpeed's, what the warning says)
DIFFERENCES = [
    (
        "WarmupCosineLR warmup_min_ratio=0.2: first step",
        lambda: WarmupCosineLR(sgd(), 10, warmup_min_ratio=0.2, warmup_num_steps=4),
        0.2 * OPTIMIZER_LR,
        0.0,
        "first optimizer step uses warmup_min_ratio",
    ),
    (
        "OneCycle: first beta1 and beta2",
        lambda: OneCycle(adam(), 0.01, 0.1, cycle_first_step_size=3),
        (0.9, 0.999),
        (0.8, 0.99),
        "beta2 stays each group's own",
    ),
]


@pytest.mark.parametrize(
    "case, build, ours, deepspeeds, warning", DIFFERENCES, ids=[row[0] for row in DIFFERENCES]
)
def test_deliberate_differences_warn(case, build, ours, deepspeeds, warning):
    with pytest.warns(DeepSpeedDifferenceWarning, match=warning):
        scheduler = build()
    group = scheduler.optimizer.param_groups[0]
    got = group["betas"] if isinstance(ours, tuple) else group["lr"]
    assert got == pytest.approx(ours), f"{case}: {got} (DeepSpeed 0.19: {deepspeeds})"


def test_no_difference_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedDifferenceWarning)
        WarmupCosineLR(sgd(), 10)  # warmup_min_ratio 0: 0 before the first step, as DeepSpeed
        OneCycle(sgd(), 0.01, 0.1)  # SGD has no betas: nothing cycles, as in DeepSpeed
        WarmupDecayLR(sgd(), 10)
