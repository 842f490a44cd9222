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
    _ds_loaded_state,
    _ds_weights,
    _shardwise_loaded_state,
    adamw,
    config,
    model,
    train,
)


def grouped_adamw(module: torch.nn.Module) -> torch.optim.Optimizer:
    """Two parameter groups, weights then biases (weight decay on the weights only)."""
    named = list(module.named_parameters())
    weights = [p for n, p in named if n.endswith("weight")]
    biases = [p for n, p in named if n.endswith("bias")]
    groups = [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.01)


def setup(cell: tuple, seed: int) -> tuple:
    """Model, optimizer and config of ``cell`` (stage, dtype, variant). Variant "groups": two
    parameter groups and, under ZeRO-3, ``sub_group_size`` 15, so that a group's parameters
    are cut into several sub-groups (partitions of 24, 12, 4 and 2 elements on 2 ranks)."""
    import torch.distributed as dist

    stage, dtype, variant = cell
    m = model(seed)
    cfg = config(stage, dtype, dist.get_world_size())
    if variant in ("frozen", "tied"):
        m = model(seed, variant)
        return m, adamw(m), cfg
    if variant == "groups":
        cfg["zero_optimization"]["sub_group_size"] = 15
        return m, grouped_adamw(m), cfg
    return m, adamw(m), cfg


def _shardwise_side(
    cell: tuple, path: str, before: int, after: int, fmt: str = "deepspeed"
) -> dict:
    import shardwise

    stage, dtype, _ = cell
    m, opt, cfg = setup(cell, seed=0)
    engine, *_ = shardwise.initialize(model=m, optimizer=opt, config=cfg)
    saved_losses = train(engine, 0, before, dtype)
    engine.save_checkpoint(path, client_state={"note": "from shardwise"}, format=fmt)
    held = _shardwise_loaded_state(engine, path + "-own", cell[2])
    losses = train(engine, before, after, dtype)
    params = {k: v.detach().float().clone() for k, v in engine.consolidated_state_dict().items()}
    return {"saved_losses": saved_losses, "held": held, "losses": losses, "params": params}


def _deepspeed_side(
    ds, cell: tuple, path: str, before: int, after: int, universal: bool = False
) -> dict:
    stage, dtype, _ = cell
    m, opt, cfg = setup(cell, seed=5)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = ds.initialize(model=m, optimizer=opt, config=cfg)
    load_path, client = engine.load_checkpoint(path)
    counters = (engine.global_steps, engine.global_samples, engine.get_lr())
    loaded = _ds_loaded_state(engine, stage)
    losses = train(engine, before, after, dtype)
    params = _ds_weights(ds, engine)
    out = {"loaded": loaded, "losses": losses, "params": params, "client": client}
    return out | {"counters": counters, "load_path": load_path}


def export_and_resume(cells: list, root: str, before: int = 3, after: int = 3) -> dict:
    """{cell: {"shardwise": ..., "deepspeed": ...}} (module docstring); a cell is (ZeRO
    stage, dtype, variant): "" or "groups" (``setup``)."""
    ds = _deepspeed()
    out = {}
    for cell in cells:
        path = os.path.join(root, "z{}-{}-{}".format(*cell))
        sw = _shardwise_side(cell, path, before, after)
        out[cell] = {"shardwise": sw, "deepspeed": _deepspeed_side(ds, cell, path, before, after)}
    torch.distributed.barrier()
    return out


def universal_path(root: str, cell: tuple) -> str:
    return os.path.join(root, "universal-z{}-{}-{}".format(*cell))


def universal_save(cells: list, root: str, before: int = 3, after: int = 3) -> dict:
    """{cell: shardwise's side}: it saves with format="deepspeed-universal" and goes on."""
    out = {}
    for cell in cells:
        path = universal_path(root, cell)
        out[cell] = _shardwise_side(cell, path, before, after, "deepspeed-universal")
    torch.distributed.barrier()
    return out


def universal_resume(cells: list, root: str, before: int = 3, after: int = 3) -> dict:
    """{cell: DeepSpeed's side}: it loads each universal folder with ``load_universal`` (on
    this world, another size than the saving one's) and trains ``after`` steps."""
    ds = _deepspeed()
    out = {}
    for cell in cells:
        out[cell] = _deepspeed_side(ds, cell, universal_path(root, cell), before, after, True)
    return out
