"""Real DeepSpeed runs for the import tests (test_deepspeed_import.py), and their shardwise
continuations: one tiny model, one data stream, the same optimizer and schedule on both sides.

``deepspeed_save_and_resume`` (every rank of a world): DeepSpeed 0.19 trains ``before`` steps
from seed-0 weights, saves, then a fresh DeepSpeed engine (seed-5 weights, so a load that
missed something shows) loads that checkpoint at the same layout and trains ``after`` steps:
DeepSpeed's own resume, the reference. ``shardwise_resume``: a fresh shardwise engine in
another layout loads DeepSpeed's checkpoint and trains ``after`` steps. Both return the
global-batch loss of every resumed step (the mean of the ranks' equal-sized slices) and the
final weights, and what the load restored: fp32 masters and Adam moments, whole (DeepSpeed's
through its ``safe_get_full_*`` accessors, shardwise's through a save read back), which must be
equal bit for bit whatever the layouts.

Global step k trains on 4 rows drawn from seed 100 + k, each rank taking its contiguous quarter
or half (micro-batch 4 / ranks, no accumulation), so every layout sees the same global batch.
Optimizer: torch AdamW on both sides (DeepSpeed takes it as a client optimizer), WarmupLR from
the config, no gradient clipping, no dropout.
"""

import logging
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCHEDULER = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4},
}


def model(seed: int, variant: str = "") -> nn.Module:
    """The tiny model; variant "frozen": its first bias does not train (requires_grad
    False); "tied": two more 8 x 8 layers sharing one weight (state dict names "2.weight"
    and "4.weight", one parameter)."""
    torch.manual_seed(seed)
    if variant == "tied":
        layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)]
        m = nn.Sequential(*layers, nn.Tanh(), nn.Linear(8, 3))
        m[4].weight = m[2].weight
        return m
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if variant == "frozen":
        m[0].bias.requires_grad_(False)
    return m


def adamw(module: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the parameters that train."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def config(stage: int, dtype: str, world: int) -> dict:
    """The same keys for DeepSpeed and shardwise."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every weight partitioned
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "scheduler": SCHEDULER,
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def global_batch(step: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of global step ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    return x.to(DTYPES[dtype]), y


def batch(step: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of global step ``step``."""
    x, y = global_batch(step, dtype)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return x[rows], y[rows]


def train(engine, first: int, steps: int, dtype: str) -> list[float]:
    """Global steps first..first+steps-1; the global-batch loss of each (the ranks' mean)."""
    losses = []
    for k in range(first, first + steps):
        x, y = batch(k, dtype)
        loss = F.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def in_turn(fn, calls: list[tuple[tuple, dict]]) -> list:
    """``fn(*args, **kwargs)`` for each call in turn on this rank, in one task of a world (one
    world start and DeepSpeed import serve them all): each call's result, or the traceback of
    what it raised as a string, so one call's failure is reported by its own test while the
    others still run (a rank that fails where the others wait in a collective hangs the task;
    the harness's timeout then ends it)."""
    out = []
    for args, kwargs in calls:
        try:
            out.append(fn(*args, **kwargs))
        except Exception:  # noqa: BLE001 - the test of that call shows it
            out.append(traceback.format_exc())
    return out


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # reuses the harness's world
    # The harness destroys a task's groups after it; DeepSpeed caches its own (data-parallel,
    # world clone) across engines: forget them, as a destroyed world would make it.
    from deepspeed.utils import groups

    groups._release_process_group_references(None)
    return deepspeed


def _ds_engine(ds, cfg: dict, seed: int, variant: str = ""):
    m = model(seed, variant)
    engine, *_ = ds.initialize(model=m, optimizer=adamw(m), config=cfg)
    return engine


def _ds_weights(ds, engine) -> dict:
    params = list(engine.module.parameters())
    with ds.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _ds_loaded_state(engine, stage: int) -> dict:
    """DeepSpeed's own view of what it loaded: fp32 masters and Adam moments per parameter
    (``"master/<p>"``, ``"optim/<key>/<p>"``), whole, through its public accessors."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if stage >= 1:  # collective under ZeRO: every rank asks for every parameter
        link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # ZeRO-1/2 link the states to the parameters at the first step
            link()
        for name, p in named:
            out[f"master/{name}"] = safe_get_full_fp32_param(p).detach().float().clone()
            for key in STATE_KEYS:
                out[f"optim/{key}/{name}"] = safe_get_full_optimizer_state(p, key).clone()
        return out
    wrapper = engine.optimizer  # bf16: the unfused wrapper's fp32 masters carry the state
    pairs = [(p, p) for _, p in named]
    if hasattr(wrapper, "fp32_groups"):
        masters = [m for group in wrapper.fp32_groups for m in group]
        pairs = list(zip([p for g in wrapper.fp16_groups for p in g], masters, strict=True))
    inner = getattr(wrapper, "optimizer", wrapper)
    names = {id(p): n for n, p in named}
    for p, master in pairs:
        name = names[id(p)]
        out[f"master/{name}"] = master.detach().float().clone()
        for key in STATE_KEYS:
            out[f"optim/{key}/{name}"] = inner.state[master][key].clone()
    return out


def _shardwise_loaded_state(engine, path: str, variant: str = "") -> dict | None:
    """The same, for a shardwise engine: saved, then read back whole on rank 0."""
    from shardwise.checkpoint.pieces import Piece
    from shardwise.checkpoint.reader import CheckpointReader
    from shardwise.checkpoint.reshard import fill

    engine.save_checkpoint(path, tag="loaded")
    if dist.get_rank() != 0:
        return None
    out, targets = {}, []
    for name, p in model(0, variant).named_parameters():
        if not p.requires_grad:
            continue
        for kind in ("master", *(f"optim/{k}" for k in STATE_KEYS)):
            t = out[f"{kind}/{name}"] = torch.empty(p.shape)
            targets.append(
                Piece(f"{kind}/{name}", tuple(p.shape), tuple((0, n) for n in p.shape), None, t)
            )
    with CheckpointReader(os.path.join(path, "loaded")) as reader:
        fill(reader, targets)
    return out


def deepspeed_save(stage: int, dtype: str, path: str, steps: int = 3) -> None:
    """DeepSpeed trains ``steps`` steps from seed-0 weights and saves into ``path``."""
    ds = _deepspeed()
    engine = _ds_engine(ds, config(stage, dtype, dist.get_world_size()), seed=0)
    train(engine, 0, steps, dtype)
    engine.save_checkpoint(path, client_state={"note": "from deepspeed", "step": steps})


def deepspeed_save_and_resume(
    stage: int, dtype: str, path: str, before: int = 3, after: int = 5, variant: str = ""
) -> dict:
    """DeepSpeed's run, save and own resume at the same layout (module docstring)."""
    ds = _deepspeed()
    cfg = config(stage, dtype, dist.get_world_size())
    first = _ds_engine(ds, cfg, seed=0, variant=variant)
    saved_losses = train(first, 0, before, dtype)
    first.save_checkpoint(path, client_state={"note": "from deepspeed", "step": before})
    del first
    second = _ds_engine(ds, cfg, seed=5, variant=variant)
    second.load_checkpoint(path)
    loaded = _ds_loaded_state(second, stage)
    losses = train(second, before, after, dtype)
    params = _ds_weights(ds, second)
    return {"saved_losses": saved_losses, "loaded": loaded, "losses": losses, "params": params}


def shardwise_resume(
    stage: int,
    dtype: str,
    path: str,
    scratch: str,
    before: int = 3,
    after: int = 5,
    tag: str | None = None,
    variant: str = "",
) -> dict:
    """A shardwise engine (ZeRO ``stage`` on this world) loads DeepSpeed's checkpoint (tag
    ``tag`` of ``path``, default ``latest``'s) and trains ``after`` steps; what it loaded is
    read back through a save into ``scratch``."""
    import shardwise

    m = model(5, variant)
    engine, *_ = shardwise.initialize(
        model=m, optimizer=adamw(m), config=config(stage, dtype, dist.get_world_size())
    )
    _, client = engine.load_checkpoint(path, tag=tag)
    counters = (engine.global_steps, engine.global_samples)
    lr = engine.get_lr()
    loaded = _shardwise_loaded_state(engine, scratch, variant)
    losses = train(engine, before, after, dtype)
    params = {k: v.detach().float().clone() for k, v in engine.consolidated_state_dict().items()}
    return {
        "losses": losses,
        "params": params,
        "loaded": loaded,
        "client": client,
        "counters": counters,
        "lr": lr,
    }


def _ds_pipeline(ds, zero: int, dtype: str, seed: int):
    """The model as a DeepSpeed pipeline of 2 stages (one Linear each: the same parameter
    names, "0.weight" ... "2.bias"), 2 micro-batches of 2 rows per step."""
    from deepspeed.pipe import PipelineModule

    pipe = PipelineModule(
        list(model(seed)), num_stages=2, loss_fn=_mse, partition_method="type:Linear"
    )
    cfg = {**config(zero, dtype, 1), "train_micro_batch_size_per_gpu": 2}
    cfg["gradient_accumulation_steps"] = 2
    engine, *_ = ds.initialize(model=pipe, optimizer=adamw(pipe), config=cfg)
    return engine


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def _pipe_train(engine, first: int, steps: int, dtype: str) -> list[float]:
    losses = []
    for k in range(first, first + steps):
        x, y = global_batch(k, dtype)
        micro = iter([(x[:2], y[:2]), (x[2:], y[2:])])
        losses.append(engine.train_batch(micro).item())
    return losses


def _gathered(state: dict) -> dict:
    """Every stage's entries, on every rank."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, state)
    return {k: v for part in parts for k, v in part.items()}


def deepspeed_pipeline_save_and_resume(
    zero: int, dtype: str, path: str, own_resume: bool = True, before: int = 3, after: int = 5
) -> dict:
    """``deepspeed_save_and_resume`` for a 2-stage DeepSpeed pipeline (layer files). Without
    ``own_resume`` the saving engine goes on instead (DeepSpeed 0.19 cannot load its own bf16
    pipeline checkpoints: BF16_Optimizer is handed the model file's dict, KeyError 0), and
    "loaded" is what it saved."""
    ds = _deepspeed()
    first = _ds_pipeline(ds, zero, dtype, seed=0)
    _pipe_train(first, 0, before, dtype)
    first.save_checkpoint(path, client_state={"note": "from deepspeed", "step": before})
    second = first
    if own_resume:
        del first
        second = _ds_pipeline(ds, zero, dtype, seed=5)
        second.load_checkpoint(path)
    loaded = _gathered(_ds_loaded_state(second, max(zero, 1 if dtype == "bf16" else 0)))
    losses = _pipe_train(second, before, after, dtype)
    weights = {k: v.detach().float().clone() for k, v in second.module.state_dict().items()}
    return {"loaded": loaded, "losses": losses, "params": _gathered(weights)}


def shardwise_pipeline_resume(
    stage: int, dtype: str, path: str, scratch: str, before: int = 3, after: int = 5
) -> dict:
    """``shardwise_resume`` into a shardwise pipeline of 2 stages (its PipelineModule names
    the parameters "<layer>.<param>", as DeepSpeed's model and pipeline do), 2 micro-batches
    of 2 rows per step; ZeRO ``stage`` over its single data-parallel rank."""
    import shardwise
    from shardwise.pipe import PipelineModule

    pipe = PipelineModule(list(model(seed=5)), loss_fn=_mse)
    cfg = {**config(stage, dtype, 1), "train_micro_batch_size_per_gpu": 2}
    cfg.update(gradient_accumulation_steps=2, pipeline={"stages": 2})
    # The stage is cut inside initialize: the optimizer comes from the config (torch AdamW).
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}
    engine, *_ = shardwise.initialize(model=pipe, config=cfg)
    _, client = engine.load_checkpoint(path)
    counters, lr = (engine.global_steps, engine.global_samples), engine.get_lr()
    loaded = _shardwise_loaded_state(engine, scratch)
    losses = []
    for k in range(before, before + after):
        x, y = global_batch(k, dtype)
        losses.append(engine.train_batch(iter([(x[:2], y[:2]), (x[2:], y[2:])])).item())
    params = {k: v.detach().float().clone() for k, v in engine.consolidated_state_dict().items()}
    out = {"losses": losses, "params": params, "loaded": loaded, "client": client}
    return out | {"counters": counters, "lr": lr}
