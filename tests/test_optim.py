"""build_optimizer: DeepSpeed's optimizer names and parameters onto torch.optim."""

import pytest
import torch

from shardwise.config import ConfigError, OptimizerConfig, parse_config
from shardwise.optim import build_optimizer


def params():
    return [torch.nn.Parameter(torch.ones(3))]


CLASSES = [
    ("Adam", {}, torch.optim.AdamW),  # DeepSpeed: adam_w_mode defaults to true
    ("adam", {"adam_w_mode": True, "torch_adam": True}, torch.optim.AdamW),
    ("Adam", {"adam_w_mode": False}, torch.optim.Adam),
    ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW),  # AdamW stays AdamW, as in DeepSpeed
    ("ADAMW", {}, torch.optim.AdamW),
    ("SGD", {"momentum": 0.9}, torch.optim.SGD),
    ("sgd", {}, torch.optim.SGD),
    ("Adagrad", {}, torch.optim.Adagrad),
    ("RMSprop", {}, torch.optim.RMSprop),  # any torch.optim class by name
    ("nadam", {}, torch.optim.NAdam),  # in any case
]


@pytest.mark.parametrize("name, extra, cls", CLASSES, ids=[f"{n}{e}" for n, e, _ in CLASSES])
def test_type_names(name, extra, cls):
    optimizer = build_optimizer(OptimizerConfig(name, {"lr": 0.01, **extra}), params())
    assert type(optimizer) is cls and optimizer.param_groups[0]["lr"] == 0.01


def test_adam_w_mode_false_is_l2_weight_decay_true_is_decoupled():
    """A zero gradient with weight decay 0.1, lr 0.1: AdamW shrinks p by lr*wd; Adam's L2 term is a
    gradient of wd*p that Adam normalises to a full step of lr."""
    moved = {}
    for mode in (True, False):
        weights = [torch.nn.Parameter(torch.ones(1))]
        optimizer = build_optimizer(
            OptimizerConfig("Adam", {"lr": 0.1, "weight_decay": 0.1, "adam_w_mode": mode}), weights
        )
        weights[0].grad = torch.zeros(1)
        optimizer.step()
        moved[mode] = 1.0 - weights[0].item()
    assert moved[True] == pytest.approx(0.01) and moved[False] == pytest.approx(0.1, rel=1e-4)


def test_param_groups():
    groups = [{"params": params(), "lr": 0.1}, {"params": params(), "weight_decay": 0.0}]
    optimizer = build_optimizer(
        OptimizerConfig("AdamW", {"lr": 0.01, "weight_decay": 0.05}), groups
    )
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (0.1, 0.05),
        (0.01, 0.0),
    ]


def test_betas_list_becomes_a_tuple():
    optimizer = build_optimizer(
        OptimizerConfig("Adam", {"lr": 0.01, "betas": [0.8, 0.999]}), params()
    )
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.999)


ERRORS = [
    ("Lamb", {"lr": 0.01}, "optimizer.type", "'Lamb' is not supported by shardwise"),
    ("OneBitAdam", {"lr": 0.01}, "optimizer.type", "'OneBitAdam' is not supported by shardwise"),
    ("Adamm", {"lr": 0.01}, "optimizer.type", "did you mean 'Adam'"),
    (
        "SGD",
        {"lr": 0.01, "momentun": 0.9},
        "optimizer.params.momentun",
        "unknown key 'optimizer.params.momentun' for torch.optim.SGD; did you mean 'momentum'?",
    ),
    ("SGD", {"lr": 0.01, "torch_adam": True}, "optimizer.params.torch_adam", "for torch.optim.SGD"),
    (
        "Adam",
        {"lr": 0.01, "bias_correction": False, "torch_adam": True},
        "optimizer.params.bias_correction",
        "false needs DeepSpeed's own Adam",
    ),
    ("Adam", {"lr": 0.01, "amsgrad": True}, "optimizer.params.amsgrad", "does not support AMSGrad"),
    ("Adam", {"lr": -0.001}, "optimizer.params.lr", "the learning rate must be > 0, got -0.001"),
    (
        "Adam",
        {"lr": 0.01, "max_grad_norm": 1.0},
        "optimizer.params.max_grad_norm",
        "gradient_clipping",
    ),
    ("AdamW", {"lr": "auto"}, "optimizer.params.lr", '"auto" needs a value'),
    ("AdamW", {"lr": 0.01, "amsgrad": "auto"}, "optimizer.params.amsgrad", '"auto" needs a value'),
    (
        "SGD",
        {"lr": 0.01, "momentum": 0.9, "nesterov": True, "dampening": 0.5},
        "optimizer.params",
        "torch.optim.SGD refused these parameters",
    ),
]


@pytest.mark.parametrize("name, kwargs, key, message", ERRORS, ids=[m for *_, m in ERRORS])
def test_errors_name_the_key(name, kwargs, key, message):
    with pytest.raises(ConfigError) as info:
        build_optimizer(OptimizerConfig(name, kwargs), params())
    assert info.value.key == key and message in str(info.value), str(info.value)


def test_auto_betas_eps_and_weight_decay_get_the_hf_trainer_defaults():
    cfg = OptimizerConfig(
        "AdamW", {"lr": 3e-4, "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    )
    group = build_optimizer(cfg, params()).param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.999), 1e-8, 0.0)


def test_lr_may_be_omitted_like_in_deepspeed():
    assert build_optimizer(OptimizerConfig("AdamW", {}), params()).param_groups[0]["lr"] == 1e-3


# --- the optimizer block at parse time ---------------------------------------------------

# fmt: off
OPTIMIZER_ERRORS = [
    ({"type": "Adam", "params": {"lr": -0.001}}, "optimizer.params.lr", "the learning rate must be > 0, got -0.001"),
    ({"type": "Adam", "params": {"lr": 0}}, "optimizer.params.lr", "must be > 0"),
    ({"type": "Adam", "params": {"lr": 0.001, "max_grad_norm": 1.0}}, "optimizer.params.max_grad_norm", "use the top-level key 'gradient_clipping'"),
    ({"type": "Adam", "params": {"betas": [0.9]}}, "optimizer.params.betas", "expected a list of 2 values"),
    ({"type": "Adam", "params": {"betas": [0.9, 1.5]}}, "optimizer.params.betas", "each beta must be in [0, 1)"),
    ({"type": "Adam", "params": {"eps": -1e-08}}, "optimizer.params.eps", "must be >= 0"),
    ({"type": "Adam", "params": {"lr": "0.1"}}, "optimizer.params.lr", 'expected a number, got the string "0.1"'),
    ({"params": {"lr": 0.1}}, "optimizer.type", "this key is required"),
    ("Adam", "optimizer", "expected an object like"),
]
# fmt: on


@pytest.mark.parametrize(
    "optimizer, key, message", OPTIMIZER_ERRORS, ids=[m for _, _, m in OPTIMIZER_ERRORS]
)
def test_optimizer_block_is_checked_at_parse_time(optimizer, key, message):
    with pytest.raises(ConfigError) as info:
        parse_config({"optimizer": optimizer})
    assert info.value.key == key and message in str(info.value), str(info.value)


def test_auto_in_optimizer_and_scheduler_params_is_kept_for_build_time():
    cfg = parse_config(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
        }
    )
    assert cfg.optimizer.params == {"lr": "auto"} and cfg.scheduler.params == {
        "warmup_num_steps": "auto"
    }
