"""The pipeline bubble, measured: idle fraction per stage against (p - 1) / (m + p - 1).

    python -m shardwise run --nproc-per-node 4 benchmarks/pipeline_bubble.py
    python -m shardwise run --nproc-per-node 4 benchmarks/pipeline_bubble.py --zero-bubble

A pipeline of p stages running m micro-batches keeps every stage busy for m (t_f + t_b) and
idle for (p - 1)(t_f + t_b) (the ramp up and the ramp down), for GPipe and 1F1B alike
(papers.md section 4): the idle fraction of the batch's wall time is (p - 1) / (m + p - 1).
Timing noise on a 2-core machine would swamp a real model's compute, so every stage is one
fixed-cost layer: its forward sleeps t_f and its backward t_b (a scalar weight keeps the stage
trainable). Sleeping takes no CPU, so 4 processes on 2 cores behave like 4 devices.

--zero-bubble (issue 29) measures 1F1B, ZB-H1, ZBV and DualPipeV instead, for m in
--zb-micro-batches. Each stage's layer then also has a WIDTH x WIDTH linear whose weight
gradient costs t_w (a hook on its accumulation sleeps): the backward sleeps t_b - t_w in B and
t_w in W, which the zero-bubble schedules run apart. ZBV and DualPipeV run 2 chunks per stage,
so the model is 2p layers of half the costs. Beside the measured idle fraction: the library's
simulator on the same costs, and DeepSeek's ZB1P formula (p-1)(F+B-2W) for ZB-H1.

One launch of 4 processes; p = 4 is one pipeline, p = 2 two data-parallel pipelines of 2.
Every (p, schedule, m) gets its own engine (m is the config's gradient_accumulation_steps),
built up front; rounds interleave all of them. A batch is timed between two barriers (so the
total is the slowest rank's); each stage's busy time is what its layer measured around its
sleeps; idle = 1 - busy / total. The figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common.py
from common import format_table, single_thread  # noqa: E402

import shardwise  # noqa: E402
from shardwise.parallel.pipeline.schedule import placement_of, simulate  # noqa: E402
from shardwise.pipe import LayerSpec, PipelineModule  # noqa: E402
from shardwise.plan.bubble import run_order  # noqa: E402

SCHEDULES = ("gpipe", "1f1b")
ZB_SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")
WIDTH = 8  # activation features: tiny, so messages cost nothing next to the sleeps


class Clock:
    """Seconds this process spent in fixed-cost forwards and backwards."""

    busy = 0.0


def _sleep(seconds: float) -> None:
    t0 = time.perf_counter()
    time.sleep(seconds)
    Clock.busy += time.perf_counter() - t0  # what it really took: oversleeping counts as busy


class _FixedCost(torch.autograd.Function):
    """Identity whose forward takes t_f and backward t_b of wall time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:  # noqa: ANN001
        ctx.t_b = t_b
        _sleep(t_f)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        _sleep(ctx.t_b)
        return grad, None, None


class FixedCostLayer(nn.Module):
    """x -> w * x, costing t_f seconds forward and t_b backward, whatever the machine does.
    With t_w > 0, x -> w * (x A^T) and A's weight gradient costs t_w of the t_b (module doc)."""

    def __init__(self, t_f: float, t_b: float, t_w: float = 0.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w
        if t_w > 0:
            self.a = nn.Parameter(torch.eye(WIDTH))
            self.a.register_post_accumulate_grad_hook(lambda _: _sleep(t_w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.t_w > 0:
            x = F.linear(x, self.a)
        return _FixedCost.apply(x * self.w, self.t_f, self.t_b - self.t_w)


def build_engine(p: int, schedule: str, m: int, args: argparse.Namespace) -> shardwise.Engine:
    t_f, t_b = args.t_forward / 1e3, args.t_backward / 1e3
    t_w = args.t_weight / 1e3 if args.zero_bubble else 0.0
    chunks = 2 if schedule in V_SCHEDULES else 1  # the same work per stage, in 2 halves
    model = PipelineModule(
        [LayerSpec(FixedCostLayer, t_f / chunks, t_b / chunks, t_w / chunks)] * (p * chunks),
        num_stages=p,
        loss_fn=F.mse_loss,
        partition_method="uniform",  # one layer per (virtual) stage
        chunks=chunks,
        placement="v" if chunks == 2 else None,
    )
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": m,
        "optimizer": {
            "type": "SGD",
            "params": {"lr": 1e-9},
        },  # the weights barely move: they do not matter
        "gradient_clipping": 0.0,
        "pipeline": {"schedule": schedule, "chunks": chunks},
    }
    engine, *_ = shardwise.initialize(model=model, config=config)
    return engine


def time_batch(engine: shardwise.Engine, m: int, rows: int) -> tuple[float, float]:
    """(wall seconds of one train_batch on this rank, its busy seconds).

    Every rank starts together (a barrier); train_batch ends with the loss broadcast from the
    last stage, so every stage's time spans the whole pipeline. No barrier at the end: its own
    latency would count as idle time."""
    batch = (torch.ones(rows, WIDTH), torch.zeros(rows, WIDTH))
    data = iter([batch] * m)
    dist.barrier()
    Clock.busy = 0.0
    t0 = time.perf_counter()
    engine.train_batch(data)
    return time.perf_counter() - t0, Clock.busy


def measure(args: argparse.Namespace) -> dict:
    """{(p, schedule, m): [[(wall, busy) of every rank] per round]}"""
    engines = {
        (p, s, m): build_engine(p, s, m, args)
        for p in args.stages
        for s in (ZB_SCHEDULES if args.zero_bubble else SCHEDULES)
        for m in (
            args.zb_micro_batches if args.zero_bubble else range(1, args.max_micro_batches + 1)
        )
        if not (s == "dualpipev" and m < 2 * p)
    }
    for (_, _, m), engine in engines.items():  # warm-up: the first batch describes shapes
        time_batch(engine, m, args.micro_batch)
    runs: dict = {key: [] for key in engines}
    for r in range(args.rounds):
        for (p, s, m), engine in engines.items():
            mine = torch.tensor(time_batch(engine, m, args.micro_batch), dtype=torch.float64)
            gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine)  # outside the timed region
            runs[(p, s, m)].append([tuple(g.tolist()) for g in gathered])
        if dist.get_rank() == 0:
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    return runs


def idle_per_stage(rounds: list[list[tuple[float, float]]], p: int) -> list[float]:
    """1 - busy / batch time (the slowest rank's), the median over rounds and over a stage's
    ranks (pipeline is the outermost axis: rank r runs stage r // (world / p))."""
    per = len(rounds[0]) // p
    return [
        statistics.median(
            1 - v[r][1] / max(w for w, _ in v)
            for v in rounds
            for r in range(s * per, (s + 1) * per)
        )
        for s in range(p)
    ]


def batch_ms(rounds: list[list[tuple[float, float]]]) -> float:
    """The median over rounds of the slowest rank's batch time."""
    return 1e3 * statistics.median(max(w for w, _ in v) for v in rounds)


def overhead_ms(args: argparse.Namespace, runs: dict, p: int, schedule: str) -> float:
    """delta, the least-squares fit of batch time = (m + p - 1)(t_f + t_b + delta) over m.

    The ramp is m + p - 1 slots of t_f + t_b on the critical path; every slot also pays a
    point-to-point hop, Python and wake-up latency (4 processes on 2 cores): delta."""
    t = args.t_forward + args.t_backward
    xs = [m + p - 1 for m in range(1, args.max_micro_batches + 1)]
    ws = [batch_ms(runs[(p, schedule, m)]) for m in range(1, args.max_micro_batches + 1)]
    return sum(x * (w - x * t) for x, w in zip(xs, ws, strict=True)) / sum(x * x for x in xs)


def _table(args: argparse.Namespace, runs: dict, p: int) -> tuple[str, float, dict]:
    """The table of one p, the largest |measured - model| and the fitted delta per schedule.

    model: the idle fraction the formula predicts once every slot costs t + delta instead of
    t = t_f + t_b: 1 - (1 - (p-1)/(m+p-1)) t / (t + delta)."""
    t = args.t_forward + args.t_backward
    delta = {s: overhead_ms(args, runs, p, s) for s in SCHEDULES}
    stages = [f"s{s}" for s in range(p)]
    headers = ["m", "(p-1)/(m+p-1)"]
    for name in ("GPipe", "1F1B"):
        headers += [f"{name} {x}" for x in stages] + [f"{name} model", f"{name} ms"]
    headers.append("ideal ms")
    rows, worst = [], 0.0
    for m in range(1, args.max_micro_batches + 1):
        formula = (p - 1) / (m + p - 1)
        cells = [str(m), f"{formula:.3f}"]
        for s in SCHEDULES:
            measured = idle_per_stage(runs[(p, s, m)], p)
            model = 1 - (1 - formula) * t / (t + delta[s])
            worst = max(worst, *(abs(x - model) for x in measured))
            cells += [f"{x:.3f}" for x in measured]
            cells += [f"{model:.3f}", f"{batch_ms(runs[(p, s, m)]):.0f}"]
        ideal = (m + p - 1) * t
        rows.append([*cells, f"{ideal:.0f}"])
    return format_table(headers, rows), worst, delta


def report(args: argparse.Namespace, runs: dict) -> None:
    print(
        f"\nPipeline bubble: fixed-cost stages, t_f {args.t_forward:g} ms, t_b "
        f"{args.t_backward:g} ms per micro-batch; {dist.get_world_size()} processes "
        f"(p = 2 runs as 2 data-parallel pipelines); median of {args.rounds} rounds.\n"
        "sN: idle fraction of stage N (1 - busy / batch wall time); model: the formula with "
        "each slot costing t_f + t_b + delta (delta fitted to the batch times, below); "
        "ms: batch wall time of the slowest rank; ideal: (m + p - 1)(t_f + t_b)"
    )
    worst = 0.0
    for p in args.stages:
        table, w, delta = _table(args, runs, p)
        worst = max(worst, w)
        fitted = ", ".join(f"{s} {d:.1f} ms" for s, d in delta.items())
        print(f"\np = {p} (delta per slot: {fitted})\n\n{table}")
    print(f"\nlargest |measured - model|: {worst:.3f}")
    print(f"load average (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def zb_report(args: argparse.Namespace, runs: dict) -> None:
    """--zero-bubble: per p and m, each schedule's idle fraction (the mean over stages of the
    median over rounds) beside the simulator's on the same costs, and its batch time."""
    f, b, w = args.t_forward, args.t_backward, args.t_weight
    print(
        f"\nZero-bubble schedules: fixed-cost stages, F {f:g} ms, B {b:g} ms of which W {w:g} "
        f"ms; {dist.get_world_size()} processes (p = 2: 2 data-parallel pipelines); median of "
        f"{args.rounds} rounds. idle: 1 - busy / batch wall time, mean over stages; sim: the "
        "library's simulator on these costs (messages free); ms: batch wall time."
    )
    names = {"1f1b": "1F1B", "zb-h1": "ZB-H1", "zbv": "ZBV", "dualpipev": "DualPipeV"}
    headers = ["p", "m", "ZB1P formula"]
    headers += [f"{names[s]} {x}" for s in ZB_SCHEDULES for x in ("idle", "sim", "ms")]
    rows = []
    for p in args.stages:
        for m in args.zb_micro_batches:
            bubble = (p - 1) * (f + b - 2 * w)  # DeepSeek's ZB1P row (W <= F)
            cells = [str(p), str(m), f"{bubble / (bubble + m * (f + b)):.3f}"]
            for s in ZB_SCHEDULES:
                if (p, s, m) not in runs:
                    cells += ["-", "-", "-"]
                    continue
                idle = statistics.mean(idle_per_stage(runs[(p, s, m)], p))
                cells += [f"{idle:.3f}", f"{_simulated_idle(s, p, m, f, b, w):.3f}"]
                cells.append(f"{batch_ms(runs[(p, s, m)]):.0f}")
            rows.append(cells)
    print("\n" + format_table(headers, rows))
    print(f"load average (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def _simulated_idle(schedule: str, p: int, m: int, f: float, b: float, w: float) -> float:
    chunks = 2 if schedule in V_SCHEDULES else 1
    progs = [run_order(schedule, p, s, m, chunks) for s in range(p)]  # F&B pairs in turn
    took = simulate(progs, chunks, f, b, w, placement_of(schedule))
    return 1 - m * (f + b) / took


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--max-micro-batches", type=int, default=16, help="m runs 1..this")
    p.add_argument("--t-forward", type=float, default=10.0, help="ms per stage forward")
    p.add_argument("--t-backward", type=float, default=20.0, help="ms per stage backward")
    p.add_argument("--t-weight", type=float, default=10.0, help="ms of t_b in W (zero-bubble)")
    p.add_argument("--zero-bubble", action="store_true", help="1F1B, ZB-H1, ZBV, DualPipeV")
    p.add_argument(
        "--zb-micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16]
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=2, help="rows per micro-batch")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    single_thread()
    quiet = logging.getLogger("shardwise")  # 64 engines: no start-up logs (a handler of
    quiet.addHandler(logging.NullHandler())  # our own keeps initialize from adding one)
    quiet.setLevel(logging.WARNING)
    shardwise.init_distributed()
    world = dist.get_world_size()
    bad = [p for p in args.stages if world % p]
    if bad:
        raise SystemExit(f"--stages {bad} do not divide the world of {world} processes")
    runs = measure(args)
    if dist.get_rank() == 0:
        (zb_report if args.zero_bubble else report)(args, runs)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
