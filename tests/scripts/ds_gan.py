"""A two-engine GAN written as DeepSpeedExamples' DCGAN script is (training/gan), import changed.

Generator and discriminator each get their own engine; one iteration: the discriminator
backpropagates its loss on real data and on detached fakes (two ``backward`` calls, one
``step``), then the generator backpropagates through the discriminator's engine (whose hooks
must reduce nothing then) and steps. Small MLPs on 2-D points stand in for the DCGAN (no
BatchNorm: per-rank statistics would make the run differ from one process by design).

``plain_twin(iterations)`` is the same training in plain PyTorch, one process, the global batch
at once; run as a script (under ``shardwise run``) it prints each iteration's losses as JSON.
"""

import argparse
import json
import sys

import torch
from torch import nn

import shardwise as deepspeed  # the only line that differs from a DeepSpeed script

NZ, BATCH, LR, BETAS = 4, 8, 2e-3, (0.5, 0.999)  # BATCH: the global batch


def make_nets():
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(NZ, 16), nn.ReLU(), nn.Linear(16, 2))
    net_d = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    return net_g, net_d


def batch(iteration):
    """The global batch of an iteration: real points on a ring, and the generator's noise."""
    g = torch.Generator().manual_seed(1000 + iteration)
    angle = torch.rand(BATCH, generator=g) * 6.2832
    real = torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(BATCH, 2, generator=g)
    return real, torch.randn(BATCH, NZ, generator=g)


def iteration_losses(net_g, net_d, opt_g, opt_d, real, noise, engines=False):
    """One DCGAN iteration; with ``engines`` the nets are engines (backward/step theirs)."""
    criterion = nn.BCELoss()
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)

    def backward(who, opt, loss):
        who.backward(loss) if engines else loss.backward()

    net_d.zero_grad()
    err_real = criterion(net_d(real), ones)
    backward(net_d, opt_d, err_real)
    fake = net_g(noise)
    err_fake = criterion(net_d(fake.detach()), zeros)
    backward(net_d, opt_d, err_fake)
    net_d.step() if engines else opt_d.step()
    net_g.zero_grad()
    err_g = criterion(net_d(fake), ones)  # through the discriminator: its grads are not D's step
    backward(net_g, opt_g, err_g)
    net_g.step() if engines else opt_g.step()
    return (err_real + err_fake).item(), err_g.item()


def plain_twin(iterations):
    net_g, net_d = make_nets()
    opt_g = torch.optim.Adam(net_g.parameters(), lr=LR, betas=BETAS)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=LR, betas=BETAS)
    return [iteration_losses(net_g, net_d, opt_g, opt_d, *batch(i)) for i in range(iterations)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--zero_stage", type=int, default=0)
    args = deepspeed.add_config_arguments(parser).parse_args()
    deepspeed.init_distributed()
    world, rank = deepspeed.comm.get_world_size(), deepspeed.comm.get_rank()
    net_g, net_d = make_nets()
    config = {
        "train_batch_size": BATCH,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "betas": list(BETAS)}},
        "zero_optimization": {"stage": args.zero_stage},
    }
    engine_g, opt_g, _, _ = deepspeed.initialize(model=net_g, config=config)
    engine_d, opt_d, _, _ = deepspeed.initialize(model=net_d, config=config)
    share = BATCH // world
    rows = slice(rank * share, (rank + 1) * share)
    for i in range(args.iterations):
        real, noise = batch(i)
        errs = iteration_losses(engine_g, engine_d, opt_g, opt_d, real[rows], noise[rows], True)
        # every rank's loss is a mean over its share: the global batch's loss is their mean
        both = torch.tensor(errs)
        deepspeed.comm.all_reduce(both)
        if rank == 0:
            print("GAN " + json.dumps([x / world for x in both.tolist()]))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
