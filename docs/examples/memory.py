"""ZeRO stages 0, 1 and 2 on 2 processes: the bytes of model states each rank holds.

    python docs/examples/memory.py                 # bf16 with fp32 master weights, AdamW
    python docs/examples/memory.py --fp32          # everything in fp32
    python docs/examples/memory.py --stages 0 1 2 3   # ZeRO-3 as well

``shardwise.spawn`` starts 2 processes. For each stage, each rank builds the same small MLP,
runs one training step (Adam creates its states at the first step) and reports
``engine.memory_breakdown()``: bytes of parameters, gradients, optimizer states (fp32 master
weights included) and communication buffers that this rank holds. The parent prints rank 0's
numbers beside the ZeRO paper's formula for Psi parameters on N ranks. Explained in
docs/parallelism-memory.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import shardwise

NPROCS = 2
D_IN, HIDDEN = 64, 256


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every rank builds the same weights
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D_IN))


PSI = sum(p.numel() for p in make_model().parameters())  # 64*256 + 256 + 256*64 + 64 = 33,088

# Bytes per parameter: (params, grads, optimizer states) as (whole, sharded over N).
# Mixed precision: 2-byte weights and grads; Adam keeps an fp32 master copy, momentum and
# variance (K = 12). fp32: the master copy is the parameter itself (K = 8).
FORMULAS = {
    ("bf16", 0): ((2, 0), (2, 0), (12, 0)),
    ("bf16", 1): ((2, 0), (2, 0), (0, 12)),
    ("bf16", 2): ((2, 0), (0, 2), (0, 12)),
    ("bf16", 3): ((0, 2), (0, 2), (0, 12)),
    ("fp32", 0): ((4, 0), (4, 0), (8, 0)),
    ("fp32", 1): ((4, 0), (4, 0), (0, 8)),
    ("fp32", 2): ((4, 0), (0, 4), (0, 8)),
    ("fp32", 3): ((0, 4), (0, 4), (0, 8)),
}


def measure(rank: int, stages: list[int], dtype: str) -> dict[int, dict[str, int]]:
    """Run on every rank: one engine per stage, one step, then memory_breakdown()."""
    out = {}
    for stage in stages:
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": dtype == "bf16"},
        }
        if stage == 3:  # shard every parameter, however small (DeepSpeed keeps < 1e5 whole)
            config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        engine, *_ = shardwise.initialize(model=make_model(), config=config)
        x = torch.randn(4, D_IN, generator=torch.Generator().manual_seed(rank))
        y = engine(x)  # the engine casts x to bf16 when bf16 is on
        engine.backward(F.mse_loss(y, torch.zeros_like(y)))
        engine.step()
        out[stage] = engine.memory_breakdown()
    return out


def formula(dtype: str, stage: int, n: int) -> dict[str, int]:
    kinds = ("params", "grads", "optimizer")
    got = {
        k: int(w * PSI + s * PSI / n)
        for k, (w, s) in zip(kinds, FORMULAS[dtype, stage], strict=True)
    }
    return {**got, "total": sum(got.values())}


def report(results: dict[int, dict[str, int]], dtype: str, n: int) -> str:
    kinds = ("params", "grads", "optimizer", "comm_buffers", "total")
    lines = [
        f"model states per rank, {dtype}, AdamW, Psi = {PSI:,} parameters, N = {n} ranks "
        "(measured on rank 0 / ZeRO paper's formula)",
        f"  {'stage':<6}" + "".join(f"{k:>22}" for k in kinds),
    ]
    for stage, got in results.items():
        want = formula(dtype, stage, n)
        cells = [f"{got[k]:,} / {want[k]:,}" if k in want else f"{got[k]:,}" for k in kinds]
        lines.append(f"  {stage:<6}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 + fp32 masters")
    args = p.parse_args()
    dtype = "fp32" if args.fp32 else "bf16"
    results = shardwise.spawn(
        measure, nprocs=NPROCS, args=(args.stages, dtype), backend="gloo", timeout=120
    )
    print(report(results[0], dtype, NPROCS), flush=True)


if __name__ == "__main__":
    main()
