"""The planner counts the host staging of asynchronous checkpoints (issue 26).

With ``"checkpoint": {"async": true}`` every rank keeps one host buffer per piece it saves
(checkpoint/async_save.py): a second copy of its parameters and optimizer states. The planner
(``Options(async_checkpoint=True)``, ``shardwise plan --async-checkpoint``) predicts it as
params + optimizer bytes, under the name ``engine.memory_breakdown()`` gives it,
``checkpoint_staging``, in host memory (not in the device peak); compared here with real runs.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from plan_runs import SMALL, build_for, measure_staging

from shardwise.plan import PRESETS, Layout, Options, Planner, read_model
from shardwise.plan.report import table

L = Layout
LAYOUTS = [  # (name, layout, precision): replicated, sharded, split and staged layouts
    ("dp2", L(2, 1, 1, 0, 2, 2), "fp32"),
    ("zero1-bf16", L(2, 1, 1, 1, 2, 2), "bf16"),
    ("zero3", L(2, 1, 1, 3, 2, 2), "fp32"),
    ("tp2", L(1, 2, 1, 0, 2, 2), "fp32"),
    ("pp2", L(1, 1, 2, 0, 1, 4), "fp32"),
]


def _planner(layout: Layout, precision: str, staged: bool = True) -> Planner:
    with torch.device("meta"):
        shape = read_model(build_for(layout))
    opts = Options(bucket_elements=3000, persistence_threshold=100, async_checkpoint=staged)
    machine = PRESETS["a100-80g"]
    return Planner(shape, machine, layout.global_batch, SMALL["block_size"], precision, opts)


def test_staging_is_a_copy_of_params_and_optimizer_in_host_memory():
    layout = LAYOUTS[1][1]
    plain = _planner(layout, "bf16", staged=False).evaluate(layout)
    staged = _planner(layout, "bf16").evaluate(layout)
    mem = staged["memory"]
    assert plain["memory"]["checkpoint_staging"] == 0, "counted without async checkpoints"
    assert mem["checkpoint_staging"] == mem["params"] + mem["optimizer"] > 0, mem
    same = {k: v for k, v in mem.items() if k != "checkpoint_staging"}
    assert same == {k: v for k, v in plain["memory"].items() if k != "checkpoint_staging"}, (
        "host staging changed the device memory"
    )
    assert "stage GiB" in table([staged], 1) and "stage GiB" not in table([plain], 1)


@pytest.mark.parametrize("name,layout,precision", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_predicted_staging_matches_the_engine(tmp_path, name, layout, precision):
    """Within 1%: the engine's buffers hold each piece unpadded (the planner counts the
    padded flat buffers of ZeRO-1/2) plus the model's buffers and Adam's step counters (a
    scalar per tensor), which the planner leaves out."""
    results = run_distributed(measure_staging, layout.world, layout, precision, str(tmp_path))
    planner = _planner(layout, precision)
    for rank, got in enumerate(results):
        want = planner.model_states(layout, got["stage"]).checkpoint_staging
        tag = (
            f"{name} rank {rank} (stage {got['stage']}): predicted {want}, staged {got['staging']}"
        )
        assert got["staging"] == pytest.approx(want, rel=0.01), tag
