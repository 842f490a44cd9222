"""DeepSpeed's CIFAR-10 tutorial script (DeepSpeedExamples training/cifar), import changed.

The tutorial's shape: ``--deepspeed --deepspeed_config ds_config.json``, its ``Net``, the
dataset handed to ``initialize`` (which returns the loader), inputs moved to the accelerator's
device and cast to half when ``model_engine.fp16_enabled()``, the running loss printed, the
accuracy measured at the end. CIFAR itself is replaced by 16x16 images whose class is a colour
pattern (no download); the config is the tutorial's ZeRO-2 + fp16 + CPU-offload one
(fp16_master_weights_and_grads), with DeepSpeed's monitors switched on by the test. At the end
``deepspeed.comm.log_summary()`` prints the comms logger's table, as DeepSpeed users call it.
"""

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as deepspeed  # the only line that differs from a DeepSpeed script


class Net(nn.Module):  # the tutorial's network, for 16x16 inputs
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 3)
        self.fc1 = nn.Linear(16 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))  # (B, 6, 6, 6)
        x = self.pool(F.relu(self.conv2(x)))  # (B, 16, 2, 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def make_dataset(n=512):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (n,), generator=g)
    colours = torch.randn(10, 3, 1, 1, generator=g)  # one colour per class
    images = colours[labels] + 0.5 * torch.randn(n, 3, 16, 16, generator=g)
    return torch.utils.data.TensorDataset(images, labels)


def main():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=3)
    args = deepspeed.add_config_arguments(parser).parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    trainset = make_dataset()
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )
    local_device = deepspeed.accelerator.get_accelerator().device_name(model_engine.local_rank)
    fp16 = model_engine.fp16_enabled()
    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        running_loss, batches = 0.0, 0
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if fp16:
                inputs = inputs.half()
            outputs = model_engine(inputs)
            loss = criterion(outputs.float(), labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            batches += 1
        if model_engine.global_rank == 0:
            print(f"[{epoch + 1}] loss: {running_loss / batches:.3f}")
    correct = total = 0
    with torch.no_grad():
        for images, labels in trainloader:
            outputs = model_engine(images.half() if fp16 else images)
            correct += (outputs.argmax(1) == labels).sum().item()
            total += labels.size(0)
    if model_engine.global_rank == 0:
        print(f"Accuracy of the network on the {total} train images: {100 * correct // total} %")
        print(f"optimizer {type(optimizer).__name__} global_steps {model_engine.global_steps}")
    deepspeed.comm.log_summary()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
