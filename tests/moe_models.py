"""A small model with one MoE layer, its one-process run (``setup``), and the engine's run of it.

Reference of record: one process holding all experts (``ep_size=1``), trained with plain
PyTorch on the same micro-batches the ranks see: each data rank's slice of each global batch
is one accumulated micro-batch, so every gate sees the tokens the rank's gate sees (capacity,
dropping and the auxiliary loss are per micro-batch in both), and the gradient is the mean
over micro-batches as the data-parallel average is.
"""

from functools import partial

import torch
import torch.nn.functional as F
from one_process import global_batches
from torch import nn

import shardwise
from shardwise.moe.layer import MoE
from shardwise.verify import VerifySetup

HIDDEN, EXPERTS, MB, STEPS, AUX = 8, 4, 4, 4, 0.01


class MoENet(nn.Module):
    """inp -> MoE (4 two-layer experts) + residual -> head; returns (prediction, l_aux)."""

    def __init__(self, ep: int = 1, k: int = 1, capacity_factor: float = 8.0, **moe) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 16), nn.Tanh(), nn.Linear(16, HIDDEN))
        self.moe = MoE(
            HIDDEN, expert, EXPERTS, ep, k, capacity_factor, capacity_factor,
            top2_2nd_expert_sampling=False, **moe,
        )  # fmt: skip
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.inp(x))
        y, l_aux, _ = self.moe(h)
        return self.head(y + h), l_aux


def seed_experts(model: MoENet) -> dict[str, torch.Tensor]:
    """Give each expert its own weights (copies start equal) and return the state dict."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return {k: v.clone() for k, v in model.state_dict().items()}


def make_data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 3, 6, generator=g)  # 3 tokens per sample
    return x, x.sum(-1, keepdim=True).sin()


def moe_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    pred, l_aux = out
    return F.mse_loss(pred, y) + AUX * l_aux


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return moe_loss(model(x), y)


def _whole(k: int) -> MoENet:
    """One process, all experts, each with its own weights."""
    model = MoENet(1, k)
    seed_experts(model)
    return model


def setup(dp: int, gas: int, clip: float, k: int) -> VerifySetup:
    """The run an expert-parallel layout makes, for the one-process reference (run it with
    ``split=dp*gas``: each rank's slice of each micro-step is a micro-batch of its own)."""
    config = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "gradient_clipping": clip,
    }
    batches = global_batches(make_data, MB * dp * gas, STEPS)
    return VerifySetup(partial(_whole, k), batches, config, moe_loss)


def engine_run(dp: int, ep: int, gas: int, clip: float, k: int, **extra) -> dict:
    """Every rank: the EP model loaded from the single-process weights, trained on its slices."""
    whole = seed_experts(MoENet(1, k))
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        **extra,
    }
    engine, *_ = shardwise.initialize(model=MoENet(ep, k), config=config)
    engine.load_module_state_dict(whole)
    start = engine.consolidated_state_dict()
    r = engine.dp_rank
    x, y = make_data(MB * dp * gas * STEPS)
    dtype = next(engine.module.parameters()).dtype
    losses, norms = [], []
    for step in range(STEPS):
        step_losses = []
        for g in range(gas):
            rows = slice(((step * gas + g) * dp + r) * MB, ((step * gas + g) * dp + r + 1) * MB)
            loss = loss_of(engine, x[rows].to(dtype), y[rows].to(dtype))
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
        norms.append(engine.get_global_grad_norm())
    same_start = all(torch.equal(start[k], whole[k].to(start[k].dtype)) for k in whole)
    return {
        "losses": losses,
        "norms": norms,
        "params": engine.consolidated_state_dict(),
        "start_equal": same_start and start.keys() == whole.keys(),
        "a2a_calls": shardwise.comm.stats().get("all_to_all", {}).get("calls", 0),
    }


def _engine(ep: int, zero: int, k: int = 1):
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": 300},
    }
    engine, *_ = shardwise.initialize(model=MoENet(ep, k), config=config)
    return engine


def _train(engine, steps: int, first: int = 0) -> None:
    x, y = make_data(MB * engine.dp_world_size * (first + steps))
    for step in range(first, first + steps):
        r = (step * engine.dp_world_size + engine.dp_rank) * MB
        engine.backward(loss_of(engine, x[r : r + MB], y[r : r + MB]))
        engine.step()


def checkpoint_run(path: str, save: tuple[int, int], load: tuple[int, int]) -> dict:
    """Train ``save`` = (ep, zero) for 2 steps, save; load into ``load`` = (ep, zero); both take
    one more step. Returns the saved weights, the loaded ones and both after the step."""
    a = _engine(*save)
    a.load_module_state_dict(seed_experts(MoENet(1)))
    _train(a, 2)
    a.save_checkpoint(path, tag="t")
    saved = a.consolidated_state_dict()
    b = _engine(*load)
    b.load_checkpoint(path, tag="t")
    loaded = b.consolidated_state_dict()
    _train(a, 1, first=2)
    _train(b, 1, first=2)
    return {
        "saved": saved,
        "loaded": loaded,
        "after_a": a.consolidated_state_dict(),
        "after_b": b.consolidated_state_dict(),
    }


def tutorial_run() -> dict:
    """DeepSpeed's CIFAR-10 MoE tutorial, in short: the optimizer's parameter groups from
    ``split_params_into_different_moe_groups_for_optimizer``, ``ep_size`` = the world."""
    import shardwise as deepspeed

    net = MoENet(ep=2)
    groups = {"params": list(net.parameters()), "name": "parameters"}
    params = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(groups)
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
    }
    engine, opt, *_ = deepspeed.initialize(model=net, model_parameters=params, config=config)
    x, y = make_data(MB)
    losses = []
    for _ in range(3):
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "groups": [(g.get("name"), g.get("moe")) for g in opt.param_groups]}
