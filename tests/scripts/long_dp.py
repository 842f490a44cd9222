"""Data-parallel training that goes on until stopped (the lost-host test cuts a link under it).
Writes MARKER once the first step is done; with STEPS, returns after that many (exit 0).

    python long_dp.py MARKER [STEPS]
"""

import sys
import time
from pathlib import Path

import torch

import shardwise


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    start, steps = time.monotonic(), int(sys.argv[2]) if len(sys.argv) > 2 else 10**9
    while time.monotonic() - start < 600 and engine.global_steps < steps:
        engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
        engine.step()
        if engine.global_steps == 1 and engine.global_rank == 0:
            Path(sys.argv[1]).write_text("1")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
