"""Real DeepSpeed runs with Megatron-style tensor parallelism (an ``mpu`` passed to
``deepspeed.initialize``), for test_deepspeed_tp_import.py, and their shardwise continuations.

The model, whole: ``norm`` (LayerNorm 6) -> ``fc1`` (Linear 6 -> 8) -> tanh -> ``fc2``
(Linear 8 -> 3). Written Megatron-style on ``tp`` ranks, each rank holds:

    norm.weight, norm.bias   [6]        replicated
    fc1.weight [8/tp, 6], fc1.bias [8/tp]   column-parallel: output features split (dim 0)
    fc2.weight [3, 8/tp]                row-parallel: input features split (dim 1)
    fc2.bias   [3]                      replicated, added after the all-reduce

    forward: y = allreduce_tp(tanh(copy_tp(norm(x)) @ W1_r^T + b1_r) @ W2_r^T) + b2

``copy_tp`` is the identity forward and an all-reduce of the gradient backward (the norm's
output feeds every rank's slice); the row-parallel all-reduce is the reverse. Every rank of a
tensor-parallel group sees the same rows; data-parallel ranks split the global batch of 4.
The weights come from the whole model built from one seed, cut per rank, so a DeepSpeed run
and the whole model start equal. Optimizer: torch AdamW (a client optimizer), WarmupLR.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed_runs import (
    GLOBAL_BATCH,
    SCHEDULER,
    _deepspeed,
    adamw,
    global_batch,
)
from torch import nn

SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # the rest is replicated


class Whole(nn.Module):
    """The model on one rank (the module docstring's, unsplit)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(6), nn.Linear(6, 8), nn.Linear(8, 3)
        with torch.no_grad():  # LayerNorm starts at 1 / 0: move it so a lost copy shows
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Mpu:
    """The few methods DeepSpeed 0.19 asks a Megatron ``mpu`` (engine.py, utils/groups.py):
    ranks r = dp_rank x tp + tp_rank, tensor-parallel groups of consecutive ranks."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        self.tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(self.dp)]
        self.dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
        self.tp_rank, self.dp_rank = rank % tp, rank // tp

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_groups[self.dp_rank]

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_groups[self.tp_rank]


class _CopyToTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TpModel(nn.Module):
    """The module docstring's model, this rank's slices of the whole model ``seed`` gives."""

    def __init__(self, seed: int, mpu: Mpu) -> None:
        super().__init__()
        whole, self.group = Whole(seed), mpu.get_model_parallel_group()
        self.norm, self.fc1 = nn.LayerNorm(6), nn.Linear(6, 8 // mpu.tp)
        self.fc2 = nn.Linear(8 // mpu.tp, 3)
        mine = {}
        for name, t in whole.state_dict().items():
            if name in SPLIT:
                t = t.chunk(mpu.tp, dim=SPLIT[name])[mpu.tp_rank]
            mine[name] = t.clone()
        self.load_state_dict(mine)

    def forward(self, x):
        h = _CopyToTp.apply(self.norm(x), self.group)
        h = torch.tanh(self.fc1(h))
        out = _ReduceFromTp.apply(F.linear(h, self.fc2.weight), self.group)
        return out + self.fc2.bias


def config(stage: int, dp: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": SCHEDULER,
        "steps_per_print": 10**9,
    }


def _rows(step: int, dp: int, dp_rank: int):
    x, y = global_batch(step, "fp32")
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    return x[rows], y[rows]


def _train(engine, first: int, steps: int, dp: int, dp_rank: int) -> list[float]:
    """Global steps first..; the global-batch loss of each (the mean over all ranks: the TP
    ranks of a replica hold the same loss)."""
    losses = []
    for k in range(first, first + steps):
        x, y = _rows(k, dp, dp_rank)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _whole_weights(engine, mpu: Mpu) -> dict:
    """The whole model's weights from the TP ranks' slices."""
    out = {}
    for name, t in engine.module.state_dict().items():
        if name in SPLIT:
            parts = [torch.empty_like(t) for _ in range(mpu.tp)]
            dist.all_gather(parts, t.contiguous(), group=mpu.get_model_parallel_group())
            t = torch.cat(parts, dim=SPLIT[name])
        out[name] = t.detach().float().clone()
    return out


def deepspeed_tp_save_and_resume(
    tp: int, stage: int, path: str, before: int = 3, after: int = 5
) -> dict:
    """DeepSpeed with tp tensor-parallel ranks x the rest data-parallel (ZeRO ``stage``)
    trains ``before`` steps, saves, and a fresh engine (seed-5 weights) resumes at the same
    layout for ``after`` steps: the reference."""
    ds = _deepspeed()
    mpu = Mpu(tp)
    cfg = config(stage, mpu.dp)

    def engine(seed: int):
        m = TpModel(seed, mpu)
        return ds.initialize(model=m, optimizer=adamw(m), config=cfg, mpu=mpu)[0]

    first = engine(0)
    _train(first, 0, before, mpu.dp, mpu.dp_rank)
    first.save_checkpoint(path, client_state={"note": "from deepspeed", "step": before})
    del first
    second = engine(5)
    second.load_checkpoint(path)
    losses = _train(second, before, after, mpu.dp, mpu.dp_rank)
    return {"losses": losses, "params": _whole_weights(second, mpu)}


def shardwise_resume(stage: int, path: str, tp: int = 1, before: int = 3, after: int = 5) -> dict:
    """A shardwise engine (ZeRO ``stage`` on this world, ``tp`` tensor-parallel ranks by a
    plan) loads the DeepSpeed tag of ``path`` into the whole model and trains ``after``
    steps."""
    import shardwise

    cfg = config(stage, dist.get_world_size() // tp)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp, "plan": {"fc1": "colwise", "fc2": "rowwise"}}
    engine, *_ = shardwise.initialize(model=Whole(5), config=cfg)
    _, client = engine.load_checkpoint(path)
    counters = (engine.global_steps, engine.global_samples)
    losses = _train(engine, before, after, engine.dp_world_size, engine.dp_rank)
    params = {k: v.detach().float().clone() for k, v in engine.consolidated_state_dict().items()}
    return {"losses": losses, "params": params, "client": client, "counters": counters}
