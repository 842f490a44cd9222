"""Expert parallelism against replicated experts, on the same MoE model (docs/moe.md).

    python -m shardwise run --nproc-per-node 2 benchmarks/moe.py

Two data ranks train a stack of pre-LN residual MoE feed-forward layers (``--experts``
two-layer 4x GELU MLPs each, top-``--k`` gating) on random tokens, once with the experts
split over the two ranks (``ep_size=2``: each holds half, tokens travel by all-to-all) and once
replicated (``ep_size=1``: every rank holds every expert, the expert gradients are all-reduced
with the rest). Step times are medians over ``--rounds`` blocks of ``--steps`` steps, the
two layouts interleaved so that load on the machine hits both alike.

All-to-all volume per step, against the formula: each MoE layer sends the dispatched tokens
twice forward (dispatch, combine) and twice backward (their gradients), each a tensor of
E x C x M elements, C = ceil(S / E * capacity_factor * k) slots per expert, so about
S x M x k elements (tokens x hidden x k) when the capacity factor is 1.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise import comm
from shardwise.moe.layer import MoE


class MoEStack(nn.Module):
    """``layers`` x (x + MoE(ln(x))), each MoE of ``experts`` 4x GELU MLPs."""

    def __init__(self, args: argparse.Namespace, ep: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        d = args.d_model
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(args.layers))
        expert = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.moes = nn.ModuleList(
            MoE(d, expert, args.experts, ep_size=ep, k=args.k, capacity_factor=1.0)
            for _ in range(args.layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = x.new_zeros(())
        for norm, moe in zip(self.norms, self.moes, strict=True):
            out, l_aux, _ = moe(norm(x))
            x, aux = x + out, aux + l_aux
        return x, aux


def run(args: argparse.Namespace, ep: int) -> shardwise.Engine:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = shardwise.initialize(model=MoEStack(args, ep), config=config)
    return engine


def step(engine: shardwise.Engine, args: argparse.Namespace, g: torch.Generator) -> None:
    x = torch.randn(args.micro_batch, args.seq, args.d_model, generator=g)
    out, aux = engine(x)
    engine.backward(F.mse_loss(out, x.roll(1, dims=1)) + 0.01 * aux)
    engine.step()


def time_block(engine: shardwise.Engine, args: argparse.Namespace, g: torch.Generator) -> float:
    for _ in range(args.warmup):
        step(engine, args, g)
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(engine, args, g)
    comm.barrier()
    return (time.perf_counter() - t0) / args.steps * 1e3


def a2a_bytes_per_step(engine: shardwise.Engine, args: argparse.Namespace) -> dict:
    comm.reset_stats()
    step(engine, args, torch.Generator().manual_seed(9))
    return comm.stats().get("all_to_all", {"calls": 0, "bytes": 0, "sent_bytes": 0})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    engines = {"ep2": run(args, 2), "replicated": run(args, 1)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    g = torch.Generator().manual_seed(comm.get_rank())
    for _ in range(args.rounds):
        for name, engine in engines.items():
            times[name].append(time_block(engine, args, g))
    a2a = a2a_bytes_per_step(engines["ep2"], args)
    if comm.get_rank() != 0:
        return
    tokens = args.micro_batch * args.seq
    cap = max(math.ceil(tokens / args.experts * 1.0 * args.k), 4)
    formula = 4 * args.layers * tokens * args.d_model * args.k * 4  # fp32 bytes
    exact = 4 * args.layers * args.experts * cap * args.d_model * 4
    params = {n: sum(p.numel() for p in e.module.parameters()) for n, e in engines.items()}
    print(
        f"MoE stack: {args.layers} layers, d_model {args.d_model}, {args.experts} experts, "
        f"top-{args.k}, {tokens} tokens per rank per step, 2 data ranks (gloo)"
    )
    for name in engines:
        ms = statistics.median(times[name])
        print(f"  {name:<10} {ms:8.1f} ms/step   params on this rank {params[name] / 1e6:.2f}M")
    print(
        f"  all-to-all per step (EP2): {a2a['calls']} calls, {a2a['bytes'] / 2**20:.2f} MiB "
        f"tensors ({a2a['sent_bytes'] / 2**20:.2f} MiB leaving the rank); formula 4 x layers x "
        f"tokens x hidden x k x 4 B = {formula / 2**20:.2f} MiB, with capacity padding "
        f"(E x C = {args.experts} x {cap}) {exact / 2**20:.2f} MiB"
    )


if __name__ == "__main__":
    main()
