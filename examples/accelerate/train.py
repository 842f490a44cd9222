"""A plain Accelerate training loop (no Trainer), the same script with and without DeepSpeed.

    python train.py --use_cpu --output_dir out                               # one process
    shardwise run --nproc-per-node 2 train.py --use_cpu --output_dir out --deepspeed ds_config_zero2.json
    accelerate launch --use_deepspeed --num_processes 2 --num_machines 1 \
        --deepspeed_config_file ds_config_zero3.json train.py --use_cpu --output_dir out

``--deepspeed CONFIG`` builds ``DeepSpeedPlugin(hf_ds_config=CONFIG)`` in the script;
``accelerate launch --use_deepspeed`` builds it from its own flags instead. Either way
Accelerate calls the installed ``deepspeed`` (DeepSpeed, or shardwise through
integrations/deepspeed-shim; docs/accelerate.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepspeed", help="a DeepSpeed config: DeepSpeedPlugin(hf_ds_config=...)")
    p.add_argument("--use_cpu", action="store_true", help="train on the CPU (gloo)")
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument(
        "--max_grad_norm", type=float, default=1.0, help="the config's gradient_clipping"
    )
    p.add_argument("--max_steps", type=int, default=6, help="optimizer steps")
    p.add_argument("--save_steps", type=int, default=0, help="save_state every N steps")
    p.add_argument("--resume_from_checkpoint", help="a directory save_state wrote")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def make_data(samples: int = 192) -> TensorDataset:
    """Inputs x (samples, 8) and targets y = sin(x A) (samples, 4): a smooth regression."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=g)
    y = torch.sin(x @ torch.randn(8, 4, generator=g))
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same weights in every process and every run
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    if args.use_cpu:
        # Accelerate counts processes only on the CPU's backend (gloo): the state made with
        # cpu=True first, as the Trainer's --use_cpu does, then the Accelerator with DeepSpeed
        # (Accelerator(cpu=True) itself would turn DeepSpeed off).
        PartialState(cpu=True)
    plugin = DeepSpeedPlugin(hf_ds_config=args.deepspeed) if args.deepspeed else None
    return Accelerator(
        deepspeed_plugin=plugin,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # one schedule step per optimizer step, in any number of processes (by default
        # Accelerate steps it once per process, the global batch being that much larger)
        step_scheduler_with_optimizer=False,
    )


def main() -> None:
    args = parse_args()
    accelerator = make_accelerator(args)
    set_seed(args.seed)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / (2 * args.max_steps))
    loader = DataLoader(make_data(), batch_size=args.per_device_train_batch_size)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step, skip = 0, 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        step = int(Path(args.resume_from_checkpoint).name.split("-")[-1])
        skip = step * args.gradient_accumulation_steps  # micro-batches already seen
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    losses = {}
    batches = accelerator.skip_first_batches(loader, skip) if skip else loader
    model.train()
    step_loss = 0.0  # the step's mean loss on this rank, over its accumulated micro-batches
    for x, y in batches:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            step_loss += loss.detach() / args.gradient_accumulation_steps
            accelerator.backward(loss)  # under DeepSpeed: engine.backward, then engine.step
            if accelerator.sync_gradients:  # DeepSpeed clipped already (gradient_clipping)
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()  # under DeepSpeed: nothing, the engine stepped
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            scheduler.step()
            step += 1
            # the mean over all processes: each rank's loss is over its share of the batch
            losses[step] = accelerator.reduce(step_loss, reduction="mean").item()
            step_loss = 0.0
            if args.save_steps and step % args.save_steps == 0:
                accelerator.save_state(out / f"checkpoint-{step}")
            if step == args.max_steps:
                break
    state = accelerator.get_state_dict(model)  # gathered on every rank under ZeRO-3
    if accelerator.is_main_process:
        (out / "losses.json").write_text(json.dumps(losses))
        torch.save({k: v.cpu() for k, v in state.items()}, out / "model.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
