"""A DeepSpeed-style script that never tears down its process group (no DeepSpeed script does):
a data-parallel engine takes one step and the script returns. It must exit 0 every time."""

import torch

import shardwise


def main() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    loss = engine(torch.randn(2, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()


if __name__ == "__main__":
    main()
