"""A small LightningModule fitted by Trainers: plain Lightning, or ShardwiseStrategy, one run
after another in the same processes (each run a new Trainer, strategy and model).

    python tests/scripts/lightning_fit.py OUT --devices 2 \
        --run dp '{"strategy": "shardwise"}' \
        --run zero2 '{"strategy": "shardwise", "config": {"zero_optimization": {"stage": 2}}}'

A run's keys (all optional): ``strategy`` ("plain", the default; "shardwise" with ``config``;
or a registered name such as "shardwise_zero3"), ``config``, ``epochs`` (2), ``batch`` (the
global batch, 8), ``accumulate`` (1), ``precision`` ("32-true"), ``save`` and ``resume`` (a
checkpoint path). Lightning starts the other processes itself, once (it runs this script again
with LOCAL_RANK set; the later Trainers find LOCAL_RANK and start none). For run NAME each rank
writes ``OUT/NAME/losses-rank<R>.json`` (the loss of its own batch at every step: with equal
per-rank batches their mean is the global batch's loss); rank 0 writes the final weights, whole,
to ``OUT/NAME/params.pt``, and the shapes its module holds to ``local-shapes.json``. The data are the same 32 samples in order, split over the data ranks,
so every world size and layout sees the same global batches.
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


class WholeWeights(L.Callback):
    """Under tensor parallelism the module keeps its split layers after fit: take the whole
    weights from the engine before the strategy's teardown (every rank gathers)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = trainer.strategy.engine.consolidated_state_dict()


def data(batch: int, one_process: bool) -> DataLoader:
    """32 samples. Under a distributed strategy Lightning puts a shuffling DistributedSampler
    (seed 0, reshuffled each epoch) on the loader: data rank r of W reads positions r, r + W, ...
    of one permutation, so a step's W batches are one block of it whatever W is. The
    one-process reference reads the same permutation through the same sampler."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    y = torch.sin(x[:, :4] * 2) + 0.1 * torch.randn(32, 4, generator=g)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=0) if one_process else None
    return DataLoader(ds, batch_size=batch, sampler=sampler)


def strategy(run: dict):
    name = run.get("strategy", "plain")
    if name == "plain":
        return "auto"
    from shardwise.integrations.lightning import ShardwiseStrategy  # registers "shardwise*"

    if name != "shardwise" or "config" not in run:
        return name  # a registered name: "shardwise", "shardwise_zero3"...
    return ShardwiseStrategy(config=run["config"])


def fit(out: Path, devices: int, run: dict) -> None:
    """One run (module docstring): a new model, Trainer and strategy."""
    L.seed_everything(0, verbose=False)
    model = Regressor()
    tp = run.get("config", {}).get("tensor_parallel", {}).get("size", 1)
    whole = WholeWeights()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy(run),
        max_epochs=run.get("epochs", 2), accumulate_grad_batches=run.get("accumulate", 1),
        precision=run.get("precision", "32-true"), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[whole] if tp > 1 else [],
    )  # fmt: skip
    plain = run.get("strategy", "plain") == "plain"
    loader = data(run.get("batch", 8) * tp // devices, one_process=plain)  # per data rank
    trainer.fit(model, loader, ckpt_path=run.get("resume"))
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    rank = trainer.global_rank
    out.mkdir(parents=True, exist_ok=True)
    (out / f"losses-rank{rank}.json").write_text(json.dumps(model.losses))
    if rank == 0:
        local = {k: list(v.shape) for k, v in model.state_dict().items()}  # split under TP
        (out / "local-shapes.json").write_text(json.dumps(local))
        state = whole.state if whole.state is not None else model.state_dict()
        torch.save({k: v.detach().float().cpu() for k, v in state.items()}, out / "params.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--run", nargs=2, action="append", metavar=("NAME", "JSON"), required=True)
    args = p.parse_args()
    for name, spec in args.run:
        print(f"run {name}: {spec}", flush=True)  # a failing run is named in the output
        fit(Path(args.out) / name, args.devices, json.loads(spec))
    print(f"done pid={os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
