"""A small LightningModule fitted by a Trainer: plain Lightning, or ShardwiseStrategy.

    python tests/scripts/lightning_fit.py OUT --devices 2 --strategy shardwise --config '{...}'

Lightning starts the other processes itself (it runs this script again with LOCAL_RANK set).
Each rank writes ``OUT/losses-rank<R>.json`` (the loss of its own batch at every step: with
equal per-rank batches their mean is the global batch's loss); rank 0 writes the final
weights to ``OUT/params.pt``. The global batch is ``--batch`` (split over the devices), the
data the same 32 samples in order, so every world size sees the same global batches.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Regressor(L.LightningModule):
    """Linear -> tanh -> linear, mean squared error; SGD with momentum and a step schedule
    (every optimizer state element is exercised by a resume)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(batch: int, one_process: bool) -> DataLoader:
    """32 samples. Under a distributed strategy Lightning puts a shuffling DistributedSampler
    (seed 0, reshuffled each epoch) on the loader: rank r of W reads positions r, r + W, ...
    of one permutation, so a step's W batches are one block of it whatever W is. The
    one-process reference reads the same permutation through the same sampler."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    y = torch.sin(x[:, :4] * 2) + 0.1 * torch.randn(32, 4, generator=g)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=0) if one_process else None
    return DataLoader(ds, batch_size=batch, sampler=sampler)


def strategy(args: argparse.Namespace):
    if args.strategy == "plain":
        return "auto"
    from shardwise.integrations.lightning import ShardwiseStrategy  # registers "shardwise*"

    if args.strategy != "shardwise":
        return args.strategy  # a registered name: "shardwise", "shardwise_zero3"...
    return ShardwiseStrategy(config=json.loads(args.config) if args.config else None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="plain")
    p.add_argument("--config", default="")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--resume", default=None)
    p.add_argument("--save", default=None)
    args = p.parse_args()
    L.seed_everything(0, verbose=False)
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy(args),
        max_epochs=args.epochs, accumulate_grad_batches=args.accumulate,
        precision=args.precision, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    loader = data(args.batch // args.devices, one_process=args.strategy == "plain")
    trainer.fit(model, loader, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    out, rank = Path(args.out), trainer.global_rank
    out.mkdir(parents=True, exist_ok=True)
    (out / f"losses-rank{rank}.json").write_text(json.dumps(model.losses))
    if rank == 0:
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        torch.save(state, out / "params.pt")
    print(f"done rank={rank} world={trainer.world_size} pid={os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
