"""Every module the pipeline runs is a module the optimizer updates (issue 12, item 3).

``initialize`` rewrites modules (pipeline stage, tensor-parallel split, activation
checkpointing, dtype) before it builds anything that holds references to them (the pipeline
runner, tied-weight groups, the strategy, the optimizer). Breaking that order trained silently
wrong twice (commits 77d1d58, d9972e7): the runner executed the modules from before the
tensor-parallel swap while the optimizer stepped the new ones. The check: run one
``train_batch`` with a global forward pre-hook that records every module executed, then compare
the parameters those modules own with the parameters in the optimizer's groups, by identity.
Both sets must be equal on every rank (no parameter runs without being trained, none is
trained without running). The last row replaces a weight after ``initialize`` (what the bug did) and must be caught.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from pipe_models import BLOCKS_PLAN, micro_batches, pipeline_module

import shardwise

MB = 2
# name: (model, tensor-parallel plan, options for the PipelineModule, swap a module afterwards)
ROWS = {
    "tp2-pp2 blocks": ("blocks", BLOCKS_PLAN, {}, False),
    "tp2-pp2 blocks, checkpointed": (
        "blocks",
        BLOCKS_PLAN,
        {"activation_checkpoint_interval": 1},
        False,
    ),
    "tp2-pp2 tied lm": ("lm", {"1": "colwise", "3": "rowwise"}, {}, False),
    "tp2-pp2 blocks, a weight replaced after initialize": ("blocks", BLOCKS_PLAN, {}, True),
}


def _executed_vs_updated(model: str, plan: dict, options: dict, swap: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "tensor_parallel": {"size": 2, "plan": plan},
    }
    module = pipeline_module(model, 2, **options)
    engine, *_ = shardwise.initialize(model=module, config=config)
    if swap:  # the bug class: the modules that run hold parameters the optimizer never saw
        layer = next(m for m in module.modules() if "weight" in m._parameters)
        layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
    ran: set[int] = set()
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, _: ran.update(id(p) for p in m.parameters(recurse=False))
    )
    try:
        data = micro_batches(model, engine, MB, 1, 1)
        engine.train_batch(data if engine.is_first_stage() or engine.is_last_stage() else None)
    finally:
        hook.remove()
    # A tied layer with a forward_fn (the lm's output projection) uses its module's weight
    # without calling the module, so no hook sees it: its parameters count as run.
    ran.update(id(p) for p in module.tied_modules.parameters())
    updated = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    return {"ran_only": len(ran - updated), "updated_only": len(updated - ran), "ran": len(ran)}


@pytest.mark.parametrize("row", list(ROWS))
def test_every_module_the_pipeline_runs_is_the_one_the_optimizer_updates(row):
    model, plan, options, swap = ROWS[row]
    for rank, got in enumerate(
        run_distributed(_executed_vs_updated, 4, model, plan, options, swap)
    ):
        where = f"{row}, rank {rank}"
        assert got["ran"] > 0, f"{where}: no parameterized module ran; the check is void"
        consistent = got["ran_only"] == 0 and got["updated_only"] == 0
        assert consistent != swap, (
            f"{where}: {got['ran_only']} parameters ran but are not in the optimizer, "
            f"{got['updated_only']} are in the optimizer but never ran"
        )
