"""Train and save a checkpoint after every step, for a long time (tests/test_slurm_real.py
cancels it with scancel while it saves). Writes SAVE_DIR/started once the first save is in.

    python slurm_saver.py SAVE_DIR
"""

import sys
from pathlib import Path

import torch

import shardwise


def main() -> None:
    save_dir = Path(sys.argv[1])
    torch.manual_seed(0)
    # About 8 MB of weights and Adam states per save, so a cancel often lands inside one.
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 512)
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    for step in range(100_000):
        x = torch.randn(4, 512)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        engine.save_checkpoint(str(save_dir))
        if step == 0 and engine.global_rank == 0:
            (save_dir / "started").write_text("1")


if __name__ == "__main__":
    main()
