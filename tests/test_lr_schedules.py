"""DeepSpeed's schedules: the numbers of papers.md section 6, the counting, state and building."""

import math
import warnings

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler, StepLR

from shardwise.config import ConfigError, SchedulerConfig, parse_config
from shardwise.lr_formulas import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from shardwise.lr_schedules import build_scheduler

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")


def sgd(lr=0.1, groups=1):
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr
    )


def lr_after(scheduler, iteration):
    """The lr once the scheduler's iteration is ``iteration`` (reached by step() calls)."""
    while scheduler.last_batch_iteration < iteration:
        scheduler.step()
    return scheduler.optimizer.param_groups[0]["lr"]


# papers.md section 6: min = 0, max = 0.001, W = 1000 (the cifar / DeepSpeed test configs)
WARMUP_LOG = [
    (0, 0.0),
    (1, 1.003433e-4),
    (9, 3.333333e-4),
    (99, 6.666667e-4),
    (999, 1.0e-3),
    (1000, 1.0e-3),
    (5000, 1.0e-3),
]


@pytest.mark.parametrize("iteration, lr", WARMUP_LOG)
def test_warmup_lr_log_sequence(iteration, lr):
    scheduler = WarmupLR(sgd(), warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000)
    assert lr_after(scheduler, iteration) == pytest.approx(lr, rel=1e-6, abs=1e-12), (
        f"it={iteration}"
    )


def test_warmup_exact_thirds():
    scheduler = WarmupLR(sgd(), warmup_max_lr=0.001, warmup_num_steps=1000)
    assert lr_after(scheduler, 9) == pytest.approx(0.001 / 3, rel=1e-12)
    assert lr_after(scheduler, 99) == pytest.approx(0.002 / 3, rel=1e-12)


def test_before_the_first_step_the_lr_is_min_and_k_steps_mean_iteration_k_minus_1():
    optimizer = sgd(lr=0.5)
    scheduler = WarmupLR(optimizer, warmup_min_lr=1e-4, warmup_max_lr=1e-3, warmup_num_steps=100)
    assert scheduler.last_batch_iteration == -1 and optimizer.param_groups[0]["lr"] == 1e-4
    for k in range(1, 6):
        scheduler.step()
        assert scheduler.last_batch_iteration == k - 1 and scheduler.last_epoch == k
    assert isinstance(scheduler, LRScheduler) and scheduler.get_last_lr() == [
        optimizer.param_groups[0]["lr"]
    ]


def test_warmup_linear():
    scheduler = WarmupLR(sgd(), warmup_max_lr=0.001, warmup_num_steps=10, warmup_type="linear")
    assert lr_after(scheduler, 5) == pytest.approx(0.0005)
    assert lr_after(scheduler, 10) == pytest.approx(0.001)


@pytest.mark.parametrize(
    "iteration, lr", [(999, 0.001), (1000, 0.001), (1500, 0.0005), (2000, 0.0), (2500, 0.0)]
)
def test_warmup_decay(iteration, lr):
    scheduler = WarmupDecayLR(
        sgd(), total_num_steps=2000, warmup_max_lr=0.001, warmup_num_steps=1000
    )
    assert lr_after(scheduler, iteration) == pytest.approx(lr, abs=1e-15), f"it={iteration}"


def test_warmup_steps_are_at_least_two():
    assert WarmupLR(sgd(), warmup_num_steps=0).warmup_num_steps == 2


def test_per_group_values_and_the_optimizer_lr_as_max():
    optimizer = torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in (0.1, 0.2)], lr=0.1
    )
    scheduler = WarmupLR(
        optimizer, warmup_min_lr=[0.0, 0.01], warmup_num_steps=10, warmup_type="linear"
    )
    assert scheduler.max_lrs == [0.1, 0.2], "no warmup_max_lr: each group's own lr"
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.01]
    with pytest.raises(ValueError, match="one per parameter group"):
        WarmupLR(optimizer, warmup_min_lr=[0.0, 0.0, 0.0])


def test_warmup_cosine():
    lr, warmup, total, low = 0.1, 10, 110, 0.01
    scheduler = WarmupCosineLR(
        sgd(lr),
        total_num_steps=total,
        warmup_min_ratio=0.2,
        warmup_num_steps=warmup,
        cos_min_ratio=low,
        warmup_type="linear",
    )
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * lr), (
        "before step 1: warmup_min_ratio"
    )
    assert lr_after(scheduler, 5) == pytest.approx(lr * (0.2 + 0.8 * 5 / warmup))
    assert lr_after(scheduler, warmup - 1 + 50) == pytest.approx(lr * (low + (1 - low) * 0.5)), (
        "half way down"
    )
    assert lr_after(scheduler, total - 1) == pytest.approx(lr * low), "the end of the cosine"
    assert lr_after(scheduler, total + 500) == pytest.approx(lr * low), "and it stays there"


def test_one_cycle_lr_and_momentum():
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1, betas=(0.9, 0.95))
    scheduler = OneCycle(
        optimizer,
        cycle_min_lr=0.1,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        decay_lr_rate=0.5,
        decay_step_size=2,
    )
    seen = []
    for _ in range(12):
        seen.append(
            (
                round(optimizer.param_groups[0]["lr"], 6),
                round(optimizer.param_groups[0]["betas"][0], 6),
            )
        )
        scheduler.step()
    lrs = [lr for lr, _ in seen]
    assert lrs[:9] == [0.1, 0.325, 0.55, 0.775, 1.0, 0.775, 0.55, 0.325, 0.1], (
        "up over 4, down over 4"
    )
    assert lrs[9:] == [round(0.1 / 1.25, 6), round(0.1 / 1.5, 6), round(0.1 / 1.75, 6)], (
        "then min / (1 + rate * n / size)"
    )
    assert seen[4][1] == 0.8 and seen[0][1] == 0.9, "momentum is lowest at the lr peak"
    assert optimizer.param_groups[0]["betas"][1] == 0.95, "beta2 is the optimizer's own"


def test_one_cycle_stairs_and_sgd_momentum_left_alone():
    optimizer = sgd(lr=0.5)
    scheduler = OneCycle(
        optimizer,
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        cycle_first_stair_count=2,
    )
    lrs = [lr_after(scheduler, it) for it in range(-1, 8)]
    assert lrs == [0.0, 0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0]
    assert "betas" not in optimizer.param_groups[0] and optimizer.param_groups[0]["momentum"] == 0


@pytest.mark.parametrize(
    "staircase, expected", [(False, [1e-3, 1.5e-3, 2e-3, 2.5e-3]), (True, [1e-3, 1e-3, 2e-3, 2e-3])]
)
def test_lr_range_test(staircase, expected):
    scheduler = LRRangeTest(
        sgd(),
        lr_range_test_min_lr=1e-3,
        lr_range_test_step_size=2,
        lr_range_test_staircase=staircase,
    )
    assert [lr_after(scheduler, it) for it in range(-1, 3)] == pytest.approx(expected)


def test_state_dict_round_trip_and_deepspeed_format():
    first = WarmupLR(sgd(), warmup_max_lr=0.001, warmup_num_steps=1000)
    lr_after(first, 9)
    state = first.state_dict()
    assert state["last_batch_iteration"] == 9
    for loaded in (state, {"last_batch_iteration": 9}):
        second = WarmupLR(sgd(), warmup_max_lr=0.001, warmup_num_steps=1000)
        second.load_state_dict(loaded)
        second.step()
        resumed = WarmupLR(
            sgd(), warmup_max_lr=0.001, warmup_num_steps=1000, last_batch_iteration=10
        )
        expected = pytest.approx([0.001 * math.log(11) / math.log(1000)])
        assert second.get_last_lr() == expected and resumed.get_last_lr() == expected, loaded


def test_step_with_an_iteration_jumps_there_like_deepspeed():
    scheduler = WarmupLR(sgd(), warmup_max_lr=0.001, warmup_num_steps=1000)
    scheduler.step(99)
    assert scheduler.last_batch_iteration == 99 and scheduler.get_last_lr()[0] == pytest.approx(
        0.002 / 3
    )


# --- build_scheduler --------------------------------------------------------------------------------


def test_build_deepspeed_scheduler_from_config():
    scheduler = build_scheduler(
        SchedulerConfig(
            "WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}
        ),
        sgd(),
    )
    assert type(scheduler) is WarmupLR and lr_after(scheduler, 1) == pytest.approx(
        1.003433e-4, rel=1e-6
    )


def test_other_names_fall_back_to_torch_schedulers():
    scheduler = build_scheduler(
        SchedulerConfig("StepLR", {"step_size": 2, "gamma": 0.5}), sgd(lr=1.0)
    )
    assert type(scheduler) is StepLR


def test_a_wrapped_optimizer_is_unwrapped():
    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    inner = sgd()
    assert build_scheduler(SchedulerConfig("WarmupLR", {}), Wrapper(inner)).optimizer is inner


@pytest.mark.parametrize(
    "cfg, key, message",
    [
        (
            SchedulerConfig("WarmupLR", {"warmup_num_steps": "auto"}),
            "scheduler.params.warmup_num_steps",
            '"auto" needs a value',
        ),
        (SchedulerConfig("NoSuchLR", {}), "scheduler.type", "unknown scheduler 'NoSuchLR'."),
        (
            SchedulerConfig("OneCycleLR", {"max_lr": 0.1}),
            "scheduler.params",
            "OneCycleLR refused these parameters",
        ),
        (
            SchedulerConfig("WarmupDecayLR", {"total_num_steps": 0}),
            "scheduler.params.total_num_steps",
            "must be >= 1",
        ),
    ],
)
def test_build_errors_name_the_key(cfg, key, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError) as info:
            build_scheduler(cfg, sgd())
    assert info.value.key == key and message in str(info.value), str(info.value)


def test_auto_min_and_max_lr_come_from_the_optimizer():
    scheduler = build_scheduler(
        SchedulerConfig(
            "WarmupLR", {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 4}
        ),
        sgd(lr=0.3),
    )
    assert (scheduler.min_lrs, scheduler.max_lrs) == ([0.0], [0.3])


# --- the scheduler block at parse time ----------------------------------------------------------

# fmt: off
SCHEDULER_ERRORS = [
    ({"type": "WarmupLRR"}, "scheduler.type", "did you mean 'WarmupLR'?"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}, "scheduler.params.total_num_steps", "required by WarmupDecayLR"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "scheduler.params.warmup_type", 'expected one of "log", "linear"'),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": -0.0001}}, "scheduler.params.warmup_min_lr", "must be >= 0"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": "100"}}, "scheduler.params.warmup_num_steps", 'expected an integer, got the string "100"'),
    ({"type": "StepLR", "params": {"gamma": 0.5}}, "scheduler.params.step_size", "required by StepLR"),
]
# fmt: on


@pytest.mark.parametrize(
    "scheduler, key, message", SCHEDULER_ERRORS, ids=[k for _, k, _ in SCHEDULER_ERRORS]
)
def test_scheduler_block_is_checked_at_parse_time(scheduler, key, message):
    with pytest.raises(ConfigError) as info:
        parse_config({"scheduler": scheduler})
    assert info.value.key == key and message in str(info.value), str(info.value)
