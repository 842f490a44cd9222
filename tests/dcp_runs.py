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
