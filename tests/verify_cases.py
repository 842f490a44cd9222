"""Small setups for ``shardwise verify``, some with a mistake it must find.

``run_case`` runs on every rank of a harness world (module level: it pickles by name); it
builds the named setup, applies an injected library bug if asked, and runs the layout with
the verifier's own worker code, which writes the result files the parent compares.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from shardwise.parallel.zero import stage3
from shardwise.verify.layout_names import parse_layout
from shardwise.verify.setup import VerifySetup
from shardwise.verify.worker import run_layout

TP_PLAN = {"fc1": "colwise", "fc2": "rowwise"}  # hidden features split between the two


class TinyNet(nn.Module):
    """x (B, 8) -> fc1 -> tanh -> [RMS-normalize over the hidden features] -> dropout -> fc2.

    The normalization divides each row by the RMS of *all* fc1's outputs: with fc1 split by
    columns, a rank sees only its half and divides by the wrong number (the bug of case a).
    """

    def __init__(self, norm: bool, dropout: float) -> None:
        super().__init__()
        self.norm = norm
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))  # (B, 8) @ (8, 16) -> (B, 16), or (B, 16/tp) when split
        if self.norm:
            h = h * h.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        return self.fc2(self.drop(h))  # (B, 16) @ (16, 4) -> (B, 4)


def _batches():
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def tiny_setup(norm: bool = False, dropout: float = 0.0, plan: dict | None = None) -> VerifySetup:
    """SGD with momentum: every parameter element must match (no Adam noise to allow for)."""

    def model() -> TinyNet:
        net = TinyNet(norm, dropout)
        net.tp_plan = dict(plan or TP_PLAN)
        return net

    config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "seed": 3}
    return VerifySetup(model=model, batches=_batches, config=config, loss_fn=nn.MSELoss())


CASES = {
    "mlp": lambda: tiny_setup(),
    "rms_norm_over_split_output": lambda: tiny_setup(norm=True),
    "dropout_split_streams": lambda: tiny_setup(dropout=0.5, plan={**TP_PLAN, "drop": "split_dropout"}),
    "dropout_shared_stream": lambda: tiny_setup(dropout=0.5),  # no "split_dropout" for drop
}  # fmt: skip


@contextmanager
def zero3_drops_first_master():
    """A library bug: ZeRO-3 rebinds the optimizer without its first parameter shard."""
    real = stage3.rebind_optimizer

    def rebuild(optimizer, holders, group_of):
        built = real(optimizer, holders, group_of)
        built.param_groups[0]["params"].pop(0)
        return built

    stage3.rebind_optimizer = rebuild
    try:
        yield
    finally:
        stage3.rebind_optimizer = real


def run_case(case: str, layout: str, steps: int, init: str, out: str, bug: str = "") -> None:
    """One rank's run of ``layout`` on setup ``case``, with the injected ``bug`` if named."""
    setup = CASES[case]()
    if bug == "zero3_drops_first_master":
        with zero3_drops_first_master():
            run_layout(setup, parse_layout(layout), steps, init, out)
    else:
        run_layout(setup, parse_layout(layout), steps, init, out)


def run_script(script: str, layout: str, steps: int, init: str, out: str) -> None:
    """One rank's run of ``layout`` on a script's own entry point (the examples)."""
    from shardwise.verify.setup import load_setup

    run_layout(load_setup(script), parse_layout(layout), steps, init, out)


def _teacher_batches():
    """A learnable task (y = a fixed random TinyNet's output), so that losses fall."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g) / 4
    while True:
        x = torch.randn(8, 8, generator=g)
        yield x, torch.tanh(x @ a) @ b


def quantized_setup() -> VerifySetup:
    """ZeRO++ layouts (qw, qg) on TinyNet with every parameter sharded (a persistence threshold
    of 0: the default keeps this model's small tensors whole, and those are never quantized)."""
    config = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "zero_optimization": {"stage3_param_persistence_threshold": 0},
        "seed": 3,
    }
    model = lambda: TinyNet(False, 0.0)  # noqa: E731
    return VerifySetup(model=model, batches=_teacher_batches, config=config, loss_fn=nn.MSELoss())
