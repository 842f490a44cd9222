"""Runs for test_deepspeed_export.py: shardwise saves with ``format="deepspeed"``, real
DeepSpeed 0.19 resumes the files at the same layout, and shardwise's own continuation is the
reference (the model, data, optimizer and schedule of deepspeed_runs.py).

``export_and_resume(cells, root)`` (every rank of a world): for each (ZeRO stage, dtype), a
shardwise engine trains ``before`` steps from seed-0 weights and saves into ``root/<cell>``
with format="deepspeed"; what it held at the save (fp32 masters and Adam moments, whole) is read
back through a save of its own format; it then trains ``after`` more steps. A DeepSpeed engine
of the same layout, built from seed-5 weights (a load that missed something shows), loads the
files, reports what its load restored (its safe_get_full_* accessors) and trains the same
``after`` steps. All cells run in one task: a DeepSpeed engine takes seconds to start.
"""

import os

import torch
from deepspeed_runs import (
    _deepspeed,
    _ds_engine,
    _ds_loaded_state,
    _ds_weights,
    _shardwise_loaded_state,
    adamw,
    config,
    model,
    train,
)


def _shardwise_side(stage: int, dtype: str, path: str, before: int, after: int) -> dict:
    import torch.distributed as dist

    import shardwise

    m = model(seed=0)
    cfg = config(stage, dtype, dist.get_world_size())
    engine, *_ = shardwise.initialize(model=m, optimizer=adamw(m), config=cfg)
    saved_losses = train(engine, 0, before, dtype)
    engine.save_checkpoint(path, client_state={"note": "from shardwise"}, format="deepspeed")
    held = _shardwise_loaded_state(engine, path + "-own")
    losses = train(engine, before, after, dtype)
    params = {k: v.detach().float().clone() for k, v in engine.consolidated_state_dict().items()}
    return {"saved_losses": saved_losses, "held": held, "losses": losses, "params": params}


def _deepspeed_side(ds, stage: int, dtype: str, path: str, before: int, after: int) -> dict:
    import torch.distributed as dist

    engine = _ds_engine(ds, config(stage, dtype, dist.get_world_size()), seed=5)
    load_path, client = engine.load_checkpoint(path)
    counters = (engine.global_steps, engine.global_samples, engine.get_lr())
    loaded = _ds_loaded_state(engine, stage)
    losses = train(engine, before, after, dtype)
    params = _ds_weights(ds, engine)
    out = {"loaded": loaded, "losses": losses, "params": params, "client": client}
    return out | {"counters": counters, "load_path": load_path}


def export_and_resume(cells: list, root: str, before: int = 3, after: int = 3) -> dict:
    """{cell: {"shardwise": ..., "deepspeed": ...}} (module docstring)."""
    ds = _deepspeed()
    out = {}
    for stage, dtype in cells:
        path = os.path.join(root, f"z{stage}-{dtype}")
        sw = _shardwise_side(stage, dtype, path, before, after)
        resumed = _deepspeed_side(ds, stage, dtype, path, before, after)
        out[(stage, dtype)] = {"shardwise": sw, "deepspeed": resumed}
    torch.distributed.barrier()
    return out
