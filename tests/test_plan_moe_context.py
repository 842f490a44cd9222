"""The planner on MoE models and split sequences, against real runs (issue 31).

The built-in decoder (shardwise.plan.build) with 4 experts per block, top-2, and without
experts under context parallelism trains three steps per layout (tests/plan_moe_runs.py).
The planner, given the model as a user would (built with ``ep_size=1`` and left to choose the
expert size, or built with the layout's ``ep_size`` like a user's ``--model``), predicts each
rank's parameters, gradients and optimizer states exactly (the same buckets, laid out apart
for experts over their expert-data group, as the library's partition_by_replicas), and every
collective of the data, expert and context axes call for call.
"""

from __future__ import annotations

import json

import pytest
from harness import run_distributed
from plan_moe_runs import DENSE, MOE, measure

from shardwise.launch.cli import main
from shardwise.plan import PRESETS, Layout, Options, Planner, build, read_model
from shardwise.plan.traffic import by_op

L = Layout
# (name, layout, precision, dims)
LAYOUTS = [
    ("ep2-dp2-fp32", L(2, 1, 1, 0, 2, 2, ep=2), "fp32", MOE),
    ("ep2-dp2-zero2-bf16", L(2, 1, 1, 2, 2, 2, ep=2), "bf16", MOE),
    ("ep1-dp2-zero1", L(2, 1, 1, 1, 2, 2), "fp32", MOE),
    ("ep2-dp4-zero1", L(4, 1, 1, 1, 1, 2, ep=2), "fp32", MOE),
    ("cp2-ring-zero1", L(1, 1, 1, 1, 2, 2, cp=2), "fp32", DENSE),
    ("cp2-ulysses-dp2", L(2, 1, 1, 0, 2, 1, cp=2, cp_method="ulysses"), "fp32", DENSE),
]
STATES = ("params", "grads", "optimizer")


def _planner(model, layout: Layout, precision: str, seq: int) -> Planner:
    opts = Options(bucket_elements=3000)
    return Planner(
        read_model(model), PRESETS["a100-80g"], layout.global_batch, seq, precision, opts
    )


@pytest.mark.parametrize("name,layout,precision,dims", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_prediction_matches_the_run(name, layout, precision, dims):
    results = run_distributed(measure, layout.world, layout, precision, dims)
    as_built = build(dims, ep_size=layout.ep)  # a user's --model of that expert size
    for model, how in ((build(dims), "planner's ep"), (as_built, "model's ep_size")):
        planner = _planner(model, layout, precision, dims.seq)
        view = planner.stage_view(layout, 0)
        for rank, got in enumerate(results):
            tag = f"{name} rank {rank} ({how})"
            want = {k: getattr(view.states, k) for k in STATES}
            assert want == {k: got["memory"][k] for k in STATES}, f"{tag}: model states"
            predicted = by_op(view.calls)
            for op in sorted(set(predicted) | set(got["comm"])):
                assert predicted.get(op) == got["comm"].get(op), f"{tag}: {op}"


def _records(capsys, *flags):
    assert main(["plan", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# (name, flags, expert sizes the records may take)
MOE_MODELS = [
    ("user ep_size=2", ["--model", "plan_moe_runs:user_moe_ep2"], {2}),
    ("user ep_size=1", ["--model", "plan_moe_runs:user_moe_ep1"], {1}),
    ("gpt --moe-experts 4", ["--arch", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4",
                             "--vocab", "61", "--moe-experts", "4", "--moe-k", "2"], {1, 2, 4}),
]  # fmt: skip


@pytest.mark.parametrize("name,flags,eps", MOE_MODELS, ids=[m[0] for m in MOE_MODELS])
def test_moe_models_plan(capsys, name, flags, eps):
    """Every MoE model plans (a user's ep_size=2 model used to stop with a traceback), with
    the expert sizes it can run, never ZeRO-3 (refused with MoE layers), ep > 1 on data
    parallelism only, and expert parameters sharded over dp / ep ranks."""
    recs = _records(capsys, *flags, "--seq", "16", "--procs-per-node", "4", "--global-batch", "8")
    assert recs and all(r["feasible"] for r in recs), name
    assert {r["ep"] for r in recs} == eps, name
    assert all(r["zero_stage"] != 3 for r in recs), name
    split = [r for r in recs if r["ep"] > 1]
    assert all(r["tp"] == r["pp"] == r["cp"] == 1 for r in split), name
    assert all(r["comm_bytes"]["expert"] > 0 for r in split), name


def test_expert_memory_shrinks_with_ep():
    """E / ep experts per rank: with ZeRO-0 fp32 each halving of the experts held frees
    E / ep - E / 2ep expert MLPs (8 h^2 elements each, 4 bytes) per block."""
    planner = _planner(build(MOE), Layout(4, 1, 1, 0, 1, 2), "fp32", MOE.seq)
    held = {ep: planner.model_states(Layout(4, 1, 1, 0, 1, 2, ep=ep), 0).params for ep in (1, 2, 4)}
    mlp = 4 * 8 * MOE.hidden**2 * MOE.layers
    assert held[1] - held[2] == 2 * mlp and held[2] - held[4] == mlp, held
