"""Shared pieces of the checkpoint tests: two models with dropout, their datasets, and one
training run that may stop, save, and continue in a fresh engine (new model, optimizer and
scheduler).

``train(cfg, steps, dropout, save_to, load_from, model=...)`` runs on every rank of a world; it
returns the losses of its steps and the final consolidated parameters (fp32, CPU). Models:

    "mlp"   DropMLP; under tensor parallelism MLP_PLAN splits fc1 by column and fc2 by row, and
            its dropout, between them, acts on split activations: "split_dropout", drawing
            from the per-TP-rank random stream that a checkpoint must restore
    "gpt"   the example GPT (examples/gpt/model.py) with a vocabulary of 13, which no TP size
            divides: the padded rows of the embedding and head go through the checkpoint; its
            own tp_plan (attention dropout is "split_dropout")
    "pipe"  a PipelineModule (Linear, Tanh, 2 DropBlocks, Linear: names "<layer>.<param>");
            the config's pipeline.stages cuts it, 1 stage being the single-process run of the
            same module; PIPE_PLAN splits each block's fc by column, proj by row
"""

import torch
import torch.nn.functional as F
from models import make_gpt, make_tokens
from torch import nn
from torch.utils.data import TensorDataset

import shardwise
from shardwise.parallel.tensor.random import get_rng_tracker

SAMPLES = 20  # a few global batches: every run below crosses an epoch boundary


class DropMLP(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))  # saved as a buffer

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.head(torch.tanh(self.fc2(self.drop(torch.tanh(self.fc1(x))))))


MLP_PLAN = {"fc1": "colwise", "drop": "split_dropout", "fc2": "rowwise"}


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(SAMPLES, 16, generator=g), torch.randn(SAMPLES, 4, generator=g)
    )


def _gpt(dropout: float) -> nn.Module:
    return make_gpt(seed=None, dropout=dropout)  # engine_for has seeded torch


class DropBlock(nn.Module):
    """x + proj(drop(tanh(fc(x)))): under TP the dropout acts on split activations."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2 * width)
        self.drop = nn.Dropout(p)
        self.proj = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.proj(self.drop(torch.tanh(self.fc(x))))


PIPE_PLAN = {"*.fc": "colwise", "*.drop": "split_dropout", "*.proj": "rowwise"}


def _pipe(dropout: float) -> nn.Module:
    from shardwise.pipe import LayerSpec, PipelineModule

    layers = [
        LayerSpec(nn.Linear, 16, 16),
        nn.Tanh(),
        LayerSpec(DropBlock, 16, dropout),
        LayerSpec(DropBlock, 16, dropout),
        LayerSpec(nn.Linear, 16, 4),
    ]
    return PipelineModule(layers, loss_fn=F.mse_loss)  # stages: the config's pipeline.stages


def _tokens() -> TensorDataset:
    return TensorDataset(*make_tokens(SAMPLES, seed=7))


MODELS = {  # name: (model(dropout), dataset, loss_fn: None = the model returns its loss)
    "mlp": (DropMLP, dataset, F.mse_loss),
    "gpt": (_gpt, _tokens, None),
    "pipe": (_pipe, dataset, None),  # the PipelineModule holds its loss
}


def config(**extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "seed": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4},
        },
        **extra,
    }


def engine_for(cfg: dict, dropout: float, seed: int, model: str = "mlp"):
    """A fresh engine; ``seed`` draws its initial weights and seeds its random streams (the
    TP stream too: the process-wide tracker is reset, parallelize() seeds it from ``seed``)."""
    build, data, loss_fn = MODELS[model]
    torch.manual_seed(seed)
    get_rng_tracker().reset()
    engine, *_ = shardwise.initialize(
        model=build(dropout), config=cfg, training_data=data(), loss_fn=loss_fn
    )
    return engine


def save(engine, path: str, **kw) -> None:
    engine.save_checkpoint(path, **kw)


def load(engine, path: str, **kw):
    return engine.load_checkpoint(path, **kw)


def train(
    cfg: dict, steps: int, dropout: float = 0.0, save_to=None, load_from=None, model: str = "mlp"
) -> dict:
    """``steps`` calls of train_batch; ``load_from``: a fresh engine (another init seed) loads
    that checkpoint first; ``save_to``: save after the steps (client_state = the step)."""
    engine = engine_for(cfg, dropout, seed=0 if load_from is None else 99, model=model)
    client = None
    if load_from is not None:
        _, client = load(engine, load_from)
    losses = [engine.train_batch().item() for _ in range(steps)]
    if save_to is not None:
        save(engine, save_to, client_state={"step": engine.global_steps, "note": "hello"})
    return {
        "losses": losses,
        "params": {k: v.float() for k, v in engine.consolidated_state_dict().items()},
        "client": client,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "lr": engine.get_lr(),
        "scale": engine.scaler.scale,
    }
