"""The README's quick start: a DeepSpeed-style training loop, on one process or many.

    python docs/examples/quickstart.py                                  # one process
    shardwise run --nproc-per-node 2 docs/examples/quickstart.py        # two
    python docs/examples/quickstart.py --spawn 2                        # two, from Python

A small regression (y = sum of the 8 inputs). First the loop a DeepSpeed user writes
(``engine(x)``, ``engine.backward(loss)``, ``engine.step()``), then ``engine.train_batch()``,
which runs a whole optimizer step (all gradient-accumulation micro-batches) itself.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import shardwise

CONFIG = {
    "train_batch_size": 64,  # all ranks together; the micro-batch is 64 / (ranks * accumulation)
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
    "zero_optimization": {"stage": 1},  # optimizer states sharded over the ranks
    "gradient_clipping": 1.0,  # off (0) unless set
}


def dataset(n: int = 2048) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def train(rank: int = 0, epochs: int = 2, batches: int = 20) -> float:
    """Train on this process (one rank of the world); returns the last train_batch loss."""
    torch.manual_seed(0)  # initialize() also copies rank 0's weights to every rank
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    engine, optimizer, loader, scheduler = shardwise.initialize(
        model=model, config=CONFIG, training_data=dataset(), loss_fn=F.mse_loss
    )
    say = print if engine.global_rank == 0 else (lambda *a, **k: None)
    say(
        f"{engine.world_size} process(es): micro-batch {engine.train_micro_batch_size_per_gpu()}"
        f" x {engine.gradient_accumulation_steps()} accumulation steps x "
        f"{engine.dp_world_size} ranks = {engine.train_batch_size()} samples per step"
    )
    for epoch in range(epochs):
        for x, y in loader:  # this rank's micro-batches
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)  # gradients reduced at the accumulation boundary
            engine.step()  # the optimizer steps once every 2 micro-batches
        say(f"epoch {epoch}: loss {loss.item():.4f}, {engine.global_steps} optimizer steps")
    for _ in range(batches):  # the same, one call per optimizer step
        loss = engine.train_batch()  # mean over micro-batches and ranks: equal on every rank
    say(f"train_batch: loss {loss.item():.4f} after {engine.global_steps} optimizer steps")
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spawn", type=int, default=0, help="start N processes with shardwise.spawn")
    args = p.parse_args()
    if args.spawn:
        losses = shardwise.spawn(train, nprocs=args.spawn, timeout=300)
        print(f"spawn: every rank returned the same loss: {len(set(losses)) == 1}")
    else:
        train()  # alone, or one of the ranks `shardwise run` started


if __name__ == "__main__":
    main()
