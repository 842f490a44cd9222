"""Data-parallel training that saves every 5 steps and resumes by itself, for the elastic
two-host test (tests/test_two_hosts.py): the world may shrink and grow between worker groups.

    shardwise run --nnodes 1:2 ... elastic_dp.py OUT STEPS

Rank 0 prints ``[elastic] world W starts at step S`` when a worker group starts, writes the
steps done to OUT/progress after each step, and OUT/done (the world size) at the end.
Steps are paced (0.1 s) while the test acts on them: until host 1 is killed, and while host 1
comes back. A world of 4 that resumed is the last one: its steps run unpaced.
"""

import sys
import time
from pathlib import Path

import torch

import shardwise


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "checkpoint": {
            "save_dir": str(out / "ckpts"),
            "save_interval_steps": 5,
            "auto_resume": True,
        },
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    if engine.global_rank == 0:
        print(
            f"[elastic] world {engine.world_size} starts at step {engine.global_steps}", flush=True
        )
    last = engine.world_size == 4 and engine.global_steps > 0
    while engine.global_steps < steps:
        engine.backward(engine(torch.randn(4, 16)).pow(2).mean())
        engine.step()
        if engine.global_rank == 0:
            (out / "progress").write_text(str(engine.global_steps))
        time.sleep(0.0 if last else 0.1)
    if engine.global_rank == 0:
        (out / "done").write_text(str(engine.world_size))


if __name__ == "__main__":
    main()
