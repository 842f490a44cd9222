"""The optimizer a config names is the one DeepSpeed would build, with DeepSpeed's defaults.

The table is DeepSpeed's (deepspeed/runtime/engine.py ``_configure_basic_optimizer`` and
deepspeed/ops/adam/fused_adam.py ``FusedAdam.__init__``): "Adam" and "AdamW" build FusedAdam
(lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0, bias_correction true, adam_w_mode true;
"AdamW" is decoupled whatever adam_w_mode says); ``torch_adam: true`` builds torch's class with
torch's own defaults (AdamW's weight_decay 0.01); SGD and Adagrad are torch's. We build torch's
AdamW / Adam where FusedAdam's update is the same math (bias corrected) and our FusedAdam where
it is not (bias_correction false); the test below checks that the update is the same.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.config.optim_blocks import OptimizerConfig
from shardwise.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardwise.optim import build_optimizer

FUSED = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
# (type, params) -> (class built, expected hyper-parameters of its group)
TABLE = [
    ("Adam", {}, torch.optim.AdamW, FUSED),
    ("AdamW", {}, torch.optim.AdamW, FUSED),
    ("adam", {"adam_w_mode": False}, torch.optim.Adam, FUSED),
    ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW, FUSED),
    ("Adam", {"torch_adam": True}, torch.optim.AdamW, {**FUSED, "weight_decay": 0.01}),
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, FUSED),
    (
        "Adam",
        {"bias_correction": False},
        FusedAdam,
        {**FUSED, "bias_correction": False, "adam_w_mode": True},
    ),
    (
        "Adam",
        {"bias_correction": False, "adam_w_mode": False},
        FusedAdam,
        {**FUSED, "bias_correction": False, "adam_w_mode": False},
    ),
    ("SGD", {"lr": 0.1}, torch.optim.SGD, {"lr": 0.1, "momentum": 0, "weight_decay": 0}),
    ("Adagrad", {}, torch.optim.Adagrad, {"lr": 1e-2, "weight_decay": 0}),
]


@pytest.mark.parametrize("kind, params, cls, want", TABLE, ids=lambda v: str(v)[:40])
def test_optimizer_type_builds_deepspeeds_optimizer_with_its_defaults(kind, params, cls, want):
    opt = build_optimizer(
        OptimizerConfig(type=kind, params=params), [torch.zeros(2, requires_grad=True)]
    )
    case = f"{kind} {params}"
    assert type(opt) is cls, f"{case}: built {type(opt).__name__}, DeepSpeed builds {cls.__name__}"
    group = opt.param_groups[0]
    for key, value in want.items():
        assert group[key] == value, f"{case}: {key} = {group[key]}, DeepSpeed's is {value}"


def _train(opt_cls, steps: int = 5, **kw) -> torch.Tensor:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    opt = opt_cls([p], **kw)
    for k in range(steps):
        p.grad = torch.sin(p.detach() * (k + 1))
        opt.step()
    return p.detach()


def _reference(steps: int, lr: float, wd: float, decoupled: bool, corrected: bool) -> torch.Tensor:
    """The update of FusedAdam's kernel, written out element by element."""
    torch.manual_seed(0)
    p = torch.randn(64).double()
    m, v, b1, b2, eps = torch.zeros_like(p), torch.zeros_like(p), 0.9, 0.999, 1e-8
    for t in range(1, steps + 1):
        g = torch.sin(p.float() * t).double()
        if not decoupled:
            g = g + wd * p
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        mh, vh = (m / (1 - b1**t), v / (1 - b2**t)) if corrected else (m, v)
        p = p - lr * (mh / (vh.sqrt() + eps) + (wd * p if decoupled else 0))
    return p.float()


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("corrected", [True, False])
@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
def test_fused_adam_update_matches_deepspeeds_formula(cls, corrected, decoupled):
    mode = {"adam_w_mode": decoupled} if cls is FusedAdam else {"adamw_mode": decoupled}
    got = _train(cls, lr=0.01, weight_decay=0.1, bias_correction=corrected, **mode)
    want = _reference(5, 0.01, 0.1, decoupled, corrected)
    # fp32 against an fp64 reference: a few ulps of 1 after 5 steps.
    assert torch.allclose(got, want, atol=1e-6), f"{cls.__name__} corrected={corrected}"


def test_bias_corrected_fused_adam_is_torchs_adamw():
    got = _train(FusedAdam, lr=0.01, weight_decay=0.1)
    want = _train(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    assert torch.allclose(got, want, atol=1e-6)


def test_amsgrad_is_refused_as_deepspeed_refuses_it():
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([torch.zeros(1, requires_grad=True)], amsgrad=True)
