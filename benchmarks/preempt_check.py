"""The cost of ``checkpoint.save_dir`` when nothing is saved: the per-step SIGTERM agreement.

    shardwise run --nproc-per-node 2 benchmarks/preempt_check.py [--d-model 128 --layers 2]

With a ``save_dir`` every optimizer step ends with one all-reduce of 4 bytes over the world
(launch/preempt.py ``agree``), so that a SIGTERM that reached some ranks stops all of them after
the same step. Printed: that all-reduce's median latency, alone, and the median step time of a
data-parallel GPT block stack with and without ``save_dir`` (no interval saves), in
interleaved rounds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common.py
from common import add_model_args, make_batches, make_model, median_ms, single_thread  # noqa: E402

import shardwise  # noqa: E402
from shardwise.launch.preempt import agree  # noqa: E402


def engine_for(args: argparse.Namespace, save_dir: str | None) -> object:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 10**9,
    }
    if save_dir is not None:
        config["checkpoint"] = {"save_dir": save_dir}
    engine, *_ = shardwise.initialize(model=make_model(args), config=config)
    return engine


def step_ms(engine: object, batches: list, steps: int) -> list[float]:
    times = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--calls", type=int, default=2000, help="all-reduces timed alone")
    args = parser.parse_args()
    single_thread()
    with tempfile.TemporaryDirectory() as folder:
        engines = {"off": engine_for(args, None), "save_dir": engine_for(args, folder)}
        for _ in range(50):
            agree(False)
        start = time.perf_counter()
        for _ in range(args.calls):
            agree(False)
        alone_us = (time.perf_counter() - start) / args.calls * 1e6
        rank = torch.distributed.get_rank()
        batches = make_batches(4, args.micro_batch, args.seq, seed=1 + rank)
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                step_ms(engine, batches, args.warmup)
                times[name] += step_ms(engine, batches, args.steps)
        engines["save_dir"].destroy()
    if torch.distributed.get_rank() == 0:
        off, on = median_ms(times["off"]), median_ms(times["save_dir"])
        print(
            f"preempt_check: agree() {alone_us:.0f} us; step {off:.1f} ms without save_dir, "
            f"{on:.1f} ms with ({(on / off - 1) * 100:+.1f}%)"
        )


if __name__ == "__main__":
    main()
