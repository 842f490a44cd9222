"""The MoE layer and its gate take DeepSpeed 0.19's defaults, one row per argument.

Values read from DeepSpeed's source (v0.19.0 to v0.19.8 agree):
deepspeed/moe/layer.py ``MoE.__init__`` and deepspeed/moe/sharded_moe.py ``TopKGate.__init__``,
``top1gating``, ``top2gating``. DeepSpeed's own gate defaults ``min_capacity`` to 8 while the
layer passes its 4: both are pinned. A deliberate difference would be a row here with our
value, a line in docs/moe.md's "Differences from DeepSpeed" and a warning at construction;
there is none (use_tutel and enable_expert_tensor_parallelism default to False as DeepSpeed's
do; only True is refused).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from shardwise.moe.layer import MoE
from shardwise.parallel.moe.gating import TopKGate, top1gating, top2gating

# (owner, argument, DeepSpeed 0.19's default)
TABLE = [
    (MoE, "num_experts", 1),
    (MoE, "ep_size", 1),
    (MoE, "k", 1),
    (MoE, "capacity_factor", 1.0),
    (MoE, "eval_capacity_factor", 1.0),
    (MoE, "min_capacity", 4),
    (MoE, "use_residual", False),
    (MoE, "noisy_gate_policy", None),
    (MoE, "drop_tokens", True),
    (MoE, "use_rts", True),
    (MoE, "use_tutel", False),
    (MoE, "enable_expert_tensor_parallelism", False),
    (MoE, "top2_2nd_expert_sampling", True),
    (TopKGate, "k", 1),
    (TopKGate, "capacity_factor", 1.0),
    (TopKGate, "eval_capacity_factor", 1.0),
    (TopKGate, "min_capacity", 8),
    (TopKGate, "noisy_gate_policy", None),
    (TopKGate, "drop_tokens", True),
    (TopKGate, "use_rts", True),
    (TopKGate, "top2_2nd_expert_sampling", True),
    (top1gating, "noisy_gate_policy", None),
    (top1gating, "drop_tokens", True),
    (top1gating, "use_rts", True),
    (top2gating, "drop_tokens", True),
    (top2gating, "top2_2nd_expert_sampling", True),
]
IDS = [f"{owner.__name__}.{key}" for owner, key, _ in TABLE]


def default_of(owner, key: str):
    fn = owner.__init__ if inspect.isclass(owner) else owner
    return inspect.signature(fn).parameters[key].default


@pytest.mark.parametrize("owner,key,want", TABLE, ids=IDS)
def test_default_is_deepspeeds(owner, key, want):
    got = default_of(owner, key)
    case = f"{owner.__name__}({key}=...)"
    assert got == want and type(got) is type(want), f"{case}: ours {got!r}, DeepSpeed's {want!r}"


# What MoE(hidden, expert, num_experts) hands its gate and keeps: the defaults in effect.
LAYER_KEYS = {"ep_size": "ep_size", "use_residual": "use_residual"}
GATE_KEYS = ("k", "capacity_factor", "eval_capacity_factor", "min_capacity")
GATE_KEYS += ("noisy_gate_policy", "drop_tokens", "use_rts", "top2_2nd_expert_sampling")


def test_a_default_layer_runs_with_deepspeeds_values():
    layer = MoE(8, torch.nn.Linear(8, 8), num_experts=4)
    want = {key: value for owner, key, value in TABLE if owner is MoE}
    gate = layer.deepspeed_moe.gate
    for key in GATE_KEYS:
        assert getattr(gate, key) == want[key], f"gate.{key}: {getattr(gate, key)!r}"
    for key, attr in LAYER_KEYS.items():
        assert getattr(layer, attr) == want[key], f"MoE.{attr}: {getattr(layer, attr)!r}"
    assert not hasattr(layer, "coefficient"), "use_residual=False builds no coefficient"


def test_the_table_is_the_installed_deepspeeds():
    """Where DeepSpeed is installed (the bench extra), its signatures agree with the table,
    and every defaulted argument of its MoE has a row."""
    pytest.importorskip("deepspeed", reason="deepspeed not installed (pip install -e .[bench])")
    from deepspeed.moe import layer, sharded_moe

    theirs = {
        MoE: layer.MoE.__init__,
        TopKGate: sharded_moe.TopKGate.__init__,
        top1gating: sharded_moe.top1gating,
        top2gating: sharded_moe.top2gating,
    }
    for owner, key, want in TABLE:
        got = inspect.signature(theirs[owner]).parameters[key].default
        assert got == want, f"{owner.__name__}.{key}: installed DeepSpeed has {got!r}"
    defaulted = {
        name
        for name, p in inspect.signature(layer.MoE.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    rows = {key for owner, key, _ in TABLE if owner is MoE}
    assert defaulted == rows, f"MoE arguments without a row: {sorted(defaulted - rows)}"
