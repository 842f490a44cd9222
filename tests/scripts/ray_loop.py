"""The ``train_loop_per_worker`` of tests/test_ray.py: a small regression trained inside Ray
Train's ``TorchTrainer``, by plain torch or by a shardwise engine on Ray's process group.

``train_loop({"runs": [...]})`` does each run in turn; a run is a dict:
  - ``{"kind": "plain", "out": path}``: torch alone (no shardwise) on the whole global batch;
  - ``{"kind": "shardwise", "out": path, "config": {...}, "save_at": N or None}``: the engine,
    each worker on its slice of the global batch, the global loss reported every step through
    ``shardwise.integrations.ray.report`` (a checkpoint at step ``save_at``), after loading
    the checkpoint ``resume_from`` (a path) names, if any.
Rank 0 writes ``out``: every step's global-batch loss (by step number), the final weights, and
what the run saw of the process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

STEPS, BATCH, LR, MOMENTUM = 6, 8, 0.1, 0.9


def model() -> nn.Module:
    torch.manual_seed(0)  # the same weights in every run
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 8, generator=g)
    return x, torch.sin(2 * x[:, :4]) + 0.1 * torch.randn(BATCH, 4, generator=g)


def plain(run: dict) -> None:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    sched = schedule(opt)
    losses = {}
    for step in range(1, STEPS + 1):
        x, y = global_batch(step)
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses[step] = loss.item()
    torch.save({"losses": losses, "params": net.state_dict()}, run["out"])


def with_shardwise(run: dict) -> None:
    import shardwise
    from shardwise.integrations import ray as shardwise_ray

    ray_world = dist.is_initialized()  # set up by Ray's TorchTrainer before this loop
    ray_group = dist.distributed_c10d._get_default_group() if ray_world else None
    engine, *_ = shardwise.initialize(
        model=model(),
        optimizer=lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
        lr_scheduler=schedule,
        config=run["config"],
    )
    reused = ray_world and dist.distributed_c10d._get_default_group() is ray_group
    resumed = shardwise_ray.load_checkpoint(engine, run.get("resume_from"))
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, rows = {}, BATCH // world
    while engine.global_steps < STEPS:
        x, y = global_batch(engine.global_steps + 1)
        x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole)  # equal slices: the global batch's loss is the ranks' mean
        losses[engine.global_steps] = whole.item() / world
        step = engine.global_steps
        metrics = {"loss": losses[step], "step": step}
        shardwise_ray.report(metrics, engine, checkpoint=step == run.get("save_at"),
                             client_state={"step": step})  # fmt: skip
    params = engine.consolidated_state_dict()  # every rank: ZeRO-3 gathers
    if rank == 0:
        seen = {"ray_group_reused": reused, "world": world, "resumed": resumed}
        torch.save({"losses": losses, "params": params, "seen": seen}, run["out"])


def train_loop(config: dict) -> None:
    for run in config["runs"]:
        (plain if run["kind"] == "plain" else with_shardwise)(run)
