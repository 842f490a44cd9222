"""A BERT-style masked-language-model script as DeepSpeed users write one (HelloDeepSpeed's
shape), import changed: a tiny encoder with dropout, ``training_data`` handed to
``initialize``, ``engine.train_batch()``, and a checkpoint with ``client_state`` saying where
training stopped. ``--resume`` loads the latest checkpoint and continues from the step in its
client_state; the losses it prints must be the ones an uninterrupted run printed (the
checkpoint restores weights, Adam, the LR schedule, the data position and the dropout RNG).
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as deepspeed  # the only line that differs from a DeepSpeed script

V, T, D, MASK = 32, 12, 32, 3  # vocabulary, sequence length, width, the [MASK] id


class MaskedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        layer = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, V)

    def forward(self, input_ids, labels):
        h = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        logits = self.head(self.encoder(h))  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


class MaskedSequences(torch.utils.data.Dataset):
    """Sequence i: a seeded random walk over the vocabulary, 15% of positions masked."""

    def __len__(self):
        return 512

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = (torch.arange(T) * (1 + i % 3) + torch.randint(4, V, (1,), generator=g)) % (V - 4) + 4
        masked = torch.rand(T, generator=g) < 0.15
        masked[i % T] = True  # at least one
        return {
            "input_ids": ids.masked_fill(masked, MASK),
            "labels": ids.masked_fill(~masked, -100),
        }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_at", type=int, default=3)
    parser.add_argument("--resume", action="store_true")
    args = deepspeed.add_config_arguments(parser).parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(42)
    model = MaskedLM()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 100,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": 1},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=MaskedSequences(),
        config=config,
    )
    start = 0
    if args.resume:
        path, client = engine.load_checkpoint(args.save_dir)
        start = client["step"]
        assert client["task"] == "mlm" and path is not None, client
    for step in range(start, args.steps):
        loss = engine.train_batch()
        if engine.global_rank == 0:
            print(f"MLM step {step} loss {loss.item():.8f} lr {engine.get_lr()[0]:.6f}")
        if not args.resume and step + 1 == args.save_at:
            engine.save_checkpoint(args.save_dir, client_state={"step": step + 1, "task": "mlm"})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
