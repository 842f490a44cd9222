"""The flight recorder's cost: the example GPT's training step with the recorder on and off.

    python benchmarks/recorder_overhead.py [--rounds 8] [--steps 5] [--zero-stage 3]

Two figures:

1. The recorder's own cost per call (``begin`` + ``finished``, and an async call's handle
   ``wait``), timed in one process over 100,000 calls: what it adds, without gloo's noise.
2. The example GPT (examples/gpt: 4 layers, 128 dims, 128 characters, micro-batch 16, AdamW,
   clipping 1.0; ``train_step`` as train.py runs it, the mean loss all-reduce included) on 2
   processes (data 2), in interleaved blocks of ``--steps`` steps with the recorder on, then
   off (the order alternates per round). Wall time and the process's CPU time per step, the
   median over rounds, and the calls per step.

3. The latency of one small all-reduce (4 floats, 2 processes), interleaved on three groups of
   the same two ranks: plain, with shardwise's fingerprint check (``"comms": {"fingerprint":
   true}``), and wrapped by torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks.

The share of a step = calls per step x cost per call / step time (figure 1 x the count; the
direct difference of figure 2 is within the noise of a shared machine, and printed too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import single_thread  # noqa: E402


def per_call_us(n: int = 100_000) -> dict[str, float]:
    """Microseconds per recorded call (one process, a world of one, no communication)."""
    import shardwise
    from shardwise.diagnose.recorder import FlightRecorder

    shardwise.init_distributed(verbose=False)
    rec = FlightRecorder()
    rec.configure(watchdog=False)
    t = torch.ones(4)
    kw = {"op": torch.distributed.ReduceOp.SUM, "group": None}

    class Work:
        def wait(self) -> bool:
            return True

    out = {}
    for name, work in (("blocking", None), ("async", Work())):
        start = time.perf_counter()
        for _ in range(n):
            handle = rec.finished(rec.begin("all_reduce", 16, (t,), kw), work)
            if work is not None:
                handle.wait()
        out[name] = (time.perf_counter() - start) / n * 1e6
    return out


def _worker(rank: int, args: argparse.Namespace) -> dict:
    from model import GPT, GPTConfig
    from train import train_step

    import shardwise
    from shardwise import comm

    single_thread()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=101, block_size=128, n_layer=4, n_head=4, n_embd=128))
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.zero_stage},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(comm.get_rank())
    batches = [torch.randint(0, 101, (16, 129), generator=g) for _ in range(4)]

    def data():
        i = 0
        while True:
            b = batches[i % len(batches)]
            yield b[:, :-1], b[:, 1:]
            i += 1

    stream, rec = data(), comm.recorder()
    for _ in range(3):
        train_step(engine, stream)
    comm.reset_stats()
    train_step(engine, stream)
    calls = sum(v["calls"] for v in comm.stats().values())
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            rec.configure(size=256 if on else 0)
            comm.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                train_step(engine, stream)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            times[on].append((wall / args.steps, cpu / args.steps))
    return {"calls": calls, "times": times, "latency": _latencies()}


def _latencies(n: int = 300, rounds: int = 5) -> dict[str, float]:
    """Median microseconds of a 4-float all-reduce: plain, fingerprinted, torch DETAIL."""
    import torch.distributed as dist

    from shardwise import comm, new_subgroup

    plain = new_subgroup([0, 1])
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # groups made now are wrapped by torch
    detail = new_subgroup([0, 1])
    dist.set_debug_level(dist.DebugLevel.OFF)
    rec, t = comm.recorder(), torch.ones(4)
    samples: dict[str, list[float]] = {"plain": [], "fingerprint": [], "detail": []}
    for _ in range(rounds):
        for name, group in (("plain", plain), ("fingerprint", plain), ("detail", detail)):
            rec.configure(fingerprint=name == "fingerprint")
            comm.barrier()
            start = time.perf_counter()
            for _ in range(n):
                comm.all_reduce(t, group=group)
            samples[name].append((time.perf_counter() - start) / n * 1e6)
    rec.configure(fingerprint=False)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--zero-stage", type=int, default=0, help="3: many more calls per step")
    args = p.parse_args()
    single_thread()
    import shardwise

    costs = per_call_us()
    print(
        f"recorder cost per call: {costs['blocking']:.2f} us blocking, {costs['async']:.2f} us async"
    )
    results = shardwise.spawn(_worker, 2, args=(args,))
    calls = results[0]["calls"]
    for label, i in (("wall", 0), ("cpu", 1)):
        on = statistics.median(t[i] for r in results for t in r["times"][True]) * 1e3
        off = statistics.median(t[i] for r in results for t in r["times"][False]) * 1e3
        print(
            f"GPT step ({label}): recorder on {on:.1f} ms, off {off:.1f} ms ({(on / off - 1) * 100:+.2f}%)"
        )
    lat = results[0]["latency"]
    print(
        f"4-float all_reduce: {lat['plain']:.0f} us plain, {lat['fingerprint']:.0f} us with "
        f"comms.fingerprint, {lat['detail']:.0f} us under TORCH_DISTRIBUTED_DEBUG=DETAIL"
    )
    step_ms = statistics.median(t[0] for r in results for t in r["times"][False]) * 1e3
    share = calls * costs["async"] / 1e3 / step_ms * 100
    print(
        f"{calls} recorded calls per step x {costs['async']:.2f} us = {calls * costs['async']:.0f} us "
        f"of a {step_ms:.1f} ms step: {share:.3f}%"
    )


if __name__ == "__main__":
    main()
