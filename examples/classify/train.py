"""Digits classification, data parallel with synchronized batch norm.

A small CNN on scikit-learn's bundled 8x8 digits (1,797 images, no download), trained with
shardwise's DeepSpeed-style engine. The global batch is fixed (``--batch-size``), so every
layout trains on the same samples per step; SyncBatchNorm normalizes over that global batch,
and accuracy is summed across ranks (exact even when the validation shards are uneven).

    python examples/classify/train.py                                 # one process
    python -m shardwise run --nproc-per-node 2 examples/classify/train.py --epochs 10
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import torch
from safetensors.torch import save_file
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Subset, TensorDataset

import shardwise
from shardwise.metrics import Accuracy, MeanMetric
from shardwise.parallel.data.syncbn import SyncBatchNorm, convert_sync_batchnorm


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, all ranks together")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--predictions",
        default=None,
        help="write each epoch's validation logits (keys epoch1, epoch2, ...) to this .safetensors file",
    )
    return p.parse_args()


def digits(val_fraction: float, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, val) split of the digits: x (N, 1, 8, 8) in [0, 1], y (N,) in 0..9."""
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixels are 0..16
    y = torch.tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(
        len(y), generator=torch.Generator().manual_seed(seed)
    )  # same on all ranks
    n_val = int(len(y) * val_fraction)
    val, train = perm[:n_val], perm[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def make_model() -> nn.Module:
    # 8x8 -> conv 8x8 -> conv 8x8 -> pool 4x4 -> 10 logits; BatchNorm after each conv.
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


@torch.no_grad()
def val_logits(engine: shardwise.Engine, val_set: TensorDataset) -> torch.Tensor:
    """The logits (N, 10) of every validation sample, in order, computed whole on each rank
    (the CNN is small): tests compare layouts prediction by prediction (``--predictions``)."""
    engine.eval()
    logits = engine(val_set.tensors[0].to(engine.device)).float().cpu().contiguous()
    engine.train()
    return logits


@torch.no_grad()
def evaluate(engine: shardwise.Engine, val_set: TensorDataset) -> float:
    """Global top-1 accuracy: rank r scores samples r, r + dp, ...; counts are summed."""
    engine.eval()
    shard = Subset(val_set, range(engine.dp_rank, len(val_set), engine.dp_world_size))
    acc = Accuracy()
    for x, y in torch.utils.data.DataLoader(shard, batch_size=256):
        x, y = x.to(engine.device), y.to(engine.device)
        acc.update_logits(engine(x), y)
    engine.train()
    return acc.compute(group=engine.mesh.dp_group)


def shardwise_verify() -> dict:
    """Entry point of ``shardwise verify examples/classify/train.py --layouts dp2,zero2x2``
    (docs/verify.md): this model, loss and optimizer on 32 training images per step. Data
    layouts only: the CNN has no tensor-parallel plan. SyncBatchNorm normalizes over the
    whole micro-batch of all data ranks, so the statistics match one process's."""
    train_set, _ = digits(val_fraction=0.2, seed=0)
    x, y = train_set.tensors

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(0)  # the same images at every call
        while True:
            picks = torch.randperm(len(y), generator=g)[:32]
            yield x[picks], y[picks]

    config = {"optimizer": {"type": "Adam", "params": {"lr": 3e-3}}, "seed": 0}
    return {
        "model": lambda: convert_sync_batchnorm(make_model()),
        "loss_fn": nn.CrossEntropyLoss(),
        "batches": batches,
        "config": config,
    }


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    torch.manual_seed(args.seed)  # the engine also broadcasts rank 0's weights
    train_set, val_set = digits(args.val_fraction, args.seed)
    model = convert_sync_batchnorm(make_model())
    config = {
        "train_batch_size": args.batch_size,  # micro-batch per rank = batch / data ranks
        "optimizer": {"type": "Adam", "params": {"lr": args.lr}},
        "seed": args.seed,
    }
    engine, _, loader, _ = shardwise.initialize(model=model, config=config, training_data=train_set)
    group = engine.mesh.dp_group  # BatchNorm statistics are shared by data-parallel peers only
    for m in engine.module.modules():
        if isinstance(m, SyncBatchNorm):
            m.process_group = group
    criterion = nn.CrossEntropyLoss()
    leader = engine.global_rank == 0
    logits = {"labels": val_set.tensors[1].contiguous()}  # --predictions
    if leader:
        print(
            f"digits: {len(train_set)} train, {len(val_set)} val; {engine.dp_world_size} "
            f"data-parallel rank(s), micro-batch {loader.micro_batch_size}",
            flush=True,
        )
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)  # reshuffle: the same permutation on every rank
        train_loss = MeanMetric()
        for x, y in loader:
            x, y = x.to(engine.device), y.to(engine.device)
            loss = criterion(engine(x), y)
            engine.backward(loss)
            engine.step()
            train_loss.update(loss.detach(), y.numel())
        val_acc = evaluate(engine, val_set)
        if args.predictions:
            logits[f"epoch{epoch + 1}"] = val_logits(engine, val_set)
        mean_loss = train_loss.compute(group=group)
        if leader:
            print(
                f"epoch {epoch + 1}/{args.epochs} train_loss {mean_loss:.4f} val_acc {val_acc:.4f}",
                flush=True,
            )
    val_acc = evaluate(engine, val_set)
    if args.predictions and leader:
        save_file(logits, args.predictions)
    if leader:
        elapsed = time.perf_counter() - start
        print(f"final val_acc {val_acc:.4f} ({len(val_set)} samples, {elapsed:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
