"""torch.distributed.checkpoint (DCP) runs for test_dcp_import.py: plain torch trains the model
of deepspeed_runs.py and saves with torch's own ``dcp.save`` under torchtitan's keys (model,
optimizer as ``get_state_dict`` flattens them, lr_scheduler, train_state), then goes on: the
reference a resume must match."""

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from deepspeed_runs import adamw, global_batch, model
from torch.distributed.checkpoint.state_dict import get_state_dict

from shardwise.lr_formulas import WarmupLR


def torch_save_dcp_and_go_on(path: str, before: int = 3, after: int = 5) -> dict:
    """``before`` steps, ``dcp.save`` into ``path``, ``after`` more steps (one process, the
    whole global batch per step)."""
    m = model(0)
    opt = adamw(m)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=4)
    losses = []
    for k in range(before + after):
        if k == before:
            msd, osd = get_state_dict(m, opt)
            state = {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(),
                     "train_state": {"step": before}, "dataloader": {"position": 12}}  # fmt: skip
            dcp.save(state, checkpoint_id=path)
        x, y = global_batch(k, "fp32")
        loss = F.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return {"losses": losses[before:], "params": params}


def shardwise_dcp_resume(stage: int, root: str, tag: str, scratch: str, after: int = 5) -> dict:
    """A shardwise engine (ZeRO ``stage`` on this world) loads ``root/tag`` (a DCP directory;
    torchtitan names them step-N, with no ``latest``) and trains ``after`` steps."""
    from deepspeed_runs import _shardwise_loaded_state, config, train

    import shardwise

    m = model(seed=5)
    cfg = config(stage, "fp32", torch.distributed.get_world_size())
    engine, *_ = shardwise.initialize(model=m, optimizer=adamw(m), config=cfg)
    engine.load_checkpoint(root, tag=tag)
    counters, lr = (engine.global_steps, engine.global_samples), engine.get_lr()
    loaded = _shardwise_loaded_state(engine, scratch)
    losses = train(engine, 3, after, "fp32")
    params = {k: v.detach().float().clone() for k, v in engine.consolidated_state_dict().items()}
    return {"losses": losses, "params": params, "loaded": loaded, "counters": counters, "lr": lr}


def shardwise_save_dcp_and_go_on(stage: int, path: str, scratch: str, before=3, after=3) -> dict:
    """A shardwise engine (ZeRO ``stage`` on this world) trains ``before`` steps from seed-0
    weights, saves with format="dcp" into ``path`` (a tag directory: its parent is the save
    directory), then trains ``after`` more; what it held at the save is read back whole
    through a save of its own format into ``scratch``."""
    import os

    from deepspeed_runs import _shardwise_loaded_state, config, train

    import shardwise

    m = model(seed=0)
    cfg = config(stage, "fp32", torch.distributed.get_world_size())
    engine, *_ = shardwise.initialize(model=m, optimizer=adamw(m), config=cfg)
    train(engine, 0, before, "fp32")
    root, tag = os.path.split(path)
    engine.save_checkpoint(root, tag=tag, format="dcp")
    held = _shardwise_loaded_state(engine, scratch)
    losses = train(engine, before, after, "fp32")
    return {"held": held, "losses": losses}


def torch_load_dcp_and_go_on(path: str, before: int = 3, after: int = 3) -> dict:
    """Plain torch (one process, no process group) loads the DCP directory ``path`` with
    torch's own ``dcp.load`` into ``get_state_dict(model, optimizer)`` and trains on."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    m = model(5)
    opt = adamw(m)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=4)
    msd, osd = get_state_dict(m, opt)  # allocates the optimizer's states to load into
    state = {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(),
             "train_state": {"step": 0}}  # fmt: skip
    dcp.load(state, checkpoint_id=path)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    sched.load_state_dict(state["lr_scheduler"])
    loaded = {}
    for name, p in m.named_parameters():
        loaded[f"master/{name}"] = p.detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            loaded[f"optim/{key}/{name}"] = opt.state[p][key].clone()
    out = {"loaded": loaded, "step": state["train_state"]["step"], "lr": sched.get_last_lr()}
    losses = []
    for k in range(before, before + after):
        x, y = global_batch(k, "fp32")
        loss = F.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return out | {"losses": losses}
