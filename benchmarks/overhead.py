"""The cost of the engine on one process: shardwise (world 1) vs a plain PyTorch loop.

    python benchmarks/overhead.py

No launcher, one process, one thread. Both train the same GPT block stack from the same seeded
weights on the same batches with the same torch AdamW, in interleaved rounds. The plain loop is
what a user would write without us::

    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

Whatever our step does beyond that (gradient buckets, the gradient norm, zeroing) shows up as
overhead = ours / plain; the target is <= 1.03.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common.py
from common import (  # noqa: E402
    add_model_args,
    format_table,
    make_batches,
    make_model,
    median_ms,
    n_params,
    single_thread,
)

LR, WEIGHT_DECAY = 1e-3, 0.01
TARGET = 1.03

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_plain(args: argparse.Namespace) -> Step:
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def build_ours(args: argparse.Namespace) -> Step:
    import shardwise

    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
    }
    engine, *_ = shardwise.initialize(model=model, optimizer=opt, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


def run_block(step: Step, batches: list, start: int, args: argparse.Namespace) -> tuple:
    """Warm-up then timed steps on ``batches[start:]``: (wall s, CPU s, losses)."""
    wall, cpu, losses = [], [], []
    for i in range(args.warmup + args.steps):
        x, y = batches[start + i]
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(x, y).item())
        if i >= args.warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return wall, cpu, losses


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(rounds=8)  # one process, two contenders: more rounds fit the same minute
    args = p.parse_args(argv)
    single_thread()
    names = ["plain PyTorch", "shardwise (world 1)"]
    steps = [build_plain(args), build_ours(args)]
    per_block = args.warmup + args.steps
    batches = make_batches(args.rounds * per_block, args.micro_batch, args.seq)
    wall: dict = {n: [] for n in names}
    cpu: dict = {n: [] for n in names}
    losses: dict = {n: [] for n in names}
    for r in range(args.rounds):
        for name, step in zip(names, steps, strict=True):
            w, c, ls = run_block(step, batches, r * per_block, args)
            wall[name] += w
            cpu[name] += c
            losses[name] += ls
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {median_ms(wall[n][-args.steps :]):.0f} ms" for n in names),
            flush=True,
        )
    plain, plain_cpu = median_ms(wall[names[0]]), median_ms(cpu[names[0]])
    rows = []
    for n in names:
        worst = max(abs(a - b) for a, b in zip(losses[n], losses[names[0]], strict=True))
        rows.append(
            [n, f"{median_ms(wall[n]):.1f}", f"{1e3 * min(wall[n]):.1f}"]
            + [f"{median_ms(wall[n]) / plain:.3f}", f"{median_ms(cpu[n]):.1f}"]
            + [f"{median_ms(cpu[n]) / plain_cpu:.3f}", f"{worst:.1e}"]
        )
    print(
        f"\nSingle-process overhead: GPT {args.layers}x{args.d_model}, seq {args.seq}, "
        f"{n_params(make_model(args)) / 1e6:.1f}M params, micro-batch {args.micro_batch}, "
        f"1 thread; {args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed) steps\n"
    )
    headers = ["loop", "median ms", "min ms", "ours/plain", "CPU ms", "CPU ours/plain"]
    print(format_table([*headers, "max |loss - plain|"], rows) + "\n")
    for kind, ratio in (
        ("wall", median_ms(wall[names[1]]) / plain),
        ("CPU", median_ms(cpu[names[1]]) / plain_cpu),
    ):
        verdict = "within" if ratio <= TARGET else "ABOVE"
        print(f"overhead ({kind}) {100 * (ratio - 1):+.1f}%: {verdict} the {TARGET:.2f} target")
    worst = max(abs(a - b) for a, b in zip(*losses.values(), strict=True))
    if worst > 1e-4:  # same weights, data and math: only a broken engine differs this much
        print(f"WARNING: losses differ by {worst:.1e}: the timings are not comparable")
    print(f"load average (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
