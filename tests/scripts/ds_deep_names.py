"""A DeepSpeed-style script that reaches DeepSpeed's deeper paths (import changed only).

It uses, the way DeepSpeedExamples' scripts do: the accelerator for the device, deepspeed.comm
(ranks, an all-reduce timed by the comms logger it configures, a barrier, log_summary),
runtime.utils for the seed and the memory report, ops.adam.FusedAdam as a client optimizer,
utils.log_dist, runtime.pipe's LayerSpec, runtime.zero's GatheredParameters, a checkpoint with
client_state and its resume. test_deepspeed_compat.py reads what it prints.
"""

import argparse
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F

import shardwise as deepspeed  # the only line that differs from a DeepSpeed script


def use_comm(save_dir: str) -> None:
    """deepspeed.comm as scripts call it, printing what each call answered."""
    dist = deepspeed.comm
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.configure(enabled=True, prof_all=True)  # the comms logger, without any engine
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    stats = dist.log_summary(return_dict=True)
    sizes = {op: sorted(per_size) for op, per_size in stats["summary"].items()}
    dist.configure(enabled=False)
    mark = os.path.join(save_dir, "rank1-before-barrier")
    if rank == 1:
        time.sleep(0.3)  # rank 0 reaches the barrier first and must wait for this file
        open(mark, "w").close()
    dist.barrier()
    seen = os.path.exists(mark)
    print(
        f"comm rank={rank} world={world} local_rank={dist.get_local_rank()} "
        f"all_reduce={total.item()} logged={sizes.get('all_reduce')} "
        f"count={stats['summary']['all_reduce'][4]['count']} "
        f"meta={stats['metadata']['rank']},{stats['metadata']['world_size']} "
        f"mark_after_barrier={seen}",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--save_dir", required=True)
    args = deepspeed.add_config_arguments(parser).parse_args()
    accel = deepspeed.accelerator.get_accelerator()
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name())
    local_rank = deepspeed.comm.get_local_rank()
    accel.set_device(local_rank)
    use_comm(args.save_dir)
    device = accel.device_name(local_rank)
    deepspeed.runtime.utils.set_random_seed(1234)
    accel.manual_seed_all(1234)
    spec = deepspeed.runtime.pipe.LayerSpec(torch.nn.Linear, 16, 1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), spec.build())
    with deepspeed.runtime.zero.partition_parameters.GatheredParameters(list(net.parameters())):
        pass  # nothing is partitioned outside ZeRO-3: a no-op, as in DeepSpeed
    opt = deepspeed.ops.adam.FusedAdam(net.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 100}
    engine, opt, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    rank = engine.global_rank
    for step in range(4):
        rows = slice(step * 8 + rank * 4, step * 8 + rank * 4 + 4)
        loss = F.mse_loss(engine(x[rows].to(device)), y[rows].to(device))
        engine.backward(loss)
        engine.step()
        accel.synchronize()
    deepspeed.utils.log_dist(f"loss {loss.item():.4f}", ranks=[0])
    for ranks in (None, [1], [-1]):  # DeepSpeed logs these nowhere, on rank 1, on every rank
        deepspeed.utils.log_dist(f"log_dist to {ranks}", ranks=ranks, level=logging.WARNING)
    deepspeed.runtime.utils.see_memory_usage("after training", force=True)
    engine.save_checkpoint(args.save_dir, client_state={"epoch": 7})
    _, client = engine.load_checkpoint(args.save_dir)
    if rank == 0:
        print(f"resumed epoch={client['epoch']} steps={engine.global_steps} device={device}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
