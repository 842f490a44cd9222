"""Shared pieces of the checkpoint tests: a model with dropout, a dataset, and one training run
that may stop, save, and continue in a fresh engine (new model, optimizer and scheduler).

``train(layout, steps, save_at=..., load=...)`` runs on every rank of a world; it returns the
losses of its steps and the final consolidated parameters (fp32, CPU).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import shardwise

try:  # the storage half of the checkpoint, once it lands; until then a stand-in
    from shardwise.checkpoint import storage as STORAGE

    REAL_STORAGE = True
except ImportError:
    import ckpt_fake as STORAGE

    REAL_STORAGE = False

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


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(SAMPLES, 16, generator=g), torch.randn(SAMPLES, 4, generator=g)
    )


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


def engine_for(cfg: dict, dropout: float, seed: int):
    torch.manual_seed(seed)
    engine, *_ = shardwise.initialize(
        model=DropMLP(dropout), config=cfg, training_data=dataset(), loss_fn=F.mse_loss
    )
    return engine


def save(engine, path: str, **kw) -> None:
    if REAL_STORAGE:
        engine.save_checkpoint(path, **kw)
    else:
        from shardwise.checkpoint.engine_state import save_checkpoint

        save_checkpoint(engine, path, storage=STORAGE, **kw)


def load(engine, path: str, **kw):
    if REAL_STORAGE:
        return engine.load_checkpoint(path, **kw)
    from shardwise.checkpoint.engine_state import load_checkpoint

    return load_checkpoint(engine, path, storage=STORAGE, **kw)


def train(cfg: dict, steps: int, dropout: float = 0.0, save_to=None, load_from=None) -> dict:
    """``steps`` calls of train_batch; ``load_from``: a fresh engine (another init seed) loads
    that checkpoint first; ``save_to``: save after the steps (client_state = the step)."""
    engine = engine_for(cfg, dropout, seed=0 if load_from is None else 99)
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
