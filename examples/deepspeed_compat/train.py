"""A training script written exactly as a DeepSpeed user writes one.

The only change from a DeepSpeed script is the import line: ``import shardwise as deepspeed``.
Run it with ``python -m shardwise run --nproc-per-node 2 examples/deepspeed_compat/train.py
--deepspeed --deepspeed_config examples/deepspeed_compat/ds_config.json``.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as deepspeed  # the only line that differs from a DeepSpeed script


def get_args():
    parser = argparse.ArgumentParser(description="DeepSpeed-style regression")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--epochs", type=int, default=3)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def make_dataset(n=512):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    w = torch.arange(1.0, 9.0)
    y = (x @ w).unsqueeze(1) / 8 + 0.01 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def main():
    args = get_args()
    deepspeed.init_distributed()
    torch.manual_seed(1234)
    net = Net()
    trainset = make_dataset()
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=trainset
    )
    for epoch in range(args.epochs):
        running, batches = 0.0, 0
        for inputs, labels in trainloader:
            inputs = inputs.to(model_engine.device)
            labels = labels.to(model_engine.device)
            outputs = model_engine(inputs)
            loss = F.mse_loss(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running += loss.item()
            batches += 1
        if deepspeed.comm.get_rank() == 0:
            print(f"epoch {epoch} rank {model_engine.global_rank} loss {running / batches:.4f}")
    if deepspeed.comm.get_rank() == 0:
        print(
            f"done global_steps={model_engine.global_steps} world={deepspeed.comm.get_world_size()}"
        )


if __name__ == "__main__":
    main()
