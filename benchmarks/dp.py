"""Data parallelism, side by side: shardwise (stage 0) vs torch DDP vs DeepSpeed stage 0.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/dp.py

One launch, one gloo world, every contender built in the same processes from the same seeded
weights, trained on the same batches with the same torch AdamW. Rounds interleave the
contenders (ours, DDP, DeepSpeed, ours, ...) so a machine that slows down mid-run slows all of
them alike. A step is forward + backward (with the gradient all-reduce) + optimizer step,
timed between two barriers; a step costs what the SLOWEST rank took (all-reduce max), and a
contender's figure is the median of its timed steps.

Then every contender must have produced the same losses at every step: a benchmark of a
broken engine is worth nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common.py
from common import (  # noqa: E402
    add_model_args,
    format_table,
    grad_mb,
    import_deepspeed,
    make_batches,
    make_model,
    median_ms,
    n_params,
    optimizer_tensors,
    rss_mb,
    single_thread,
    tensor_mb,
    timed_steps,
)

LR, WEIGHT_DECAY = 1e-3, 0.01
# Same weights, data and fp32 math: only the order of additions may differ between engines
# (a few ulps); a contender that trained something else is off by far more than this.
LOSS_TOLERANCE = 1e-4


@dataclass
class Contender:
    """A name, a training step on one micro-batch (returns the local loss), a memory probe."""

    name: str
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    state_mb: Callable[[], float]
    times: list[float] = field(default_factory=list)  # seconds, slowest rank, timed steps
    cpu: list[float] = field(default_factory=list)  # CPU seconds of the process, slowest rank
    losses: list[float] = field(default_factory=list)  # mean over ranks, every step
    steps_done: int = 0


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def build_ours(args: argparse.Namespace, diagnostics: bool = True) -> Contender:
    """Our stage 0; ``diagnostics=False``: the same engine with the per-step features that are
    on by default (the flight recorder of every collective) off during its blocks, to measure
    what they cost together (docs/reliability.md, "What runs every step by default")."""
    import shardwise
    from shardwise.comm import recorder

    model = make_model(args)
    opt = adamw(model)
    zero: dict = {"stage": 0}
    if args.bucket_elements:
        zero["reduce_bucket_size"] = args.bucket_elements
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
    }
    engine, *_ = shardwise.initialize(model=model, optimizer=opt, config=config)

    keep = recorder().calls.maxlen if diagnostics else 0  # the process-wide recorder: per block

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if recorder().enabled != bool(keep):
            recorder().configure(size=keep)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    def state_mb() -> float:
        # Our gradients are views of the bucket buffers: counting their storages counts the
        # buckets, without reaching into the engine's internals.
        grads = [p.grad for p in model.parameters()]
        return tensor_mb([*model.parameters(), *grads, *optimizer_tensors(opt)])

    return Contender("shardwise" if diagnostics else "shardwise, recorder off", step, state_mb)


def build_ddp(args: argparse.Namespace) -> Contender:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(args)
    ddp = DDP(model)  # torch's defaults: 25 MiB buckets, gradients copied into them
    opt = adamw(ddp)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()  # set_to_none, torch's default
        return loss

    def state_mb() -> float:
        # DDP's bucket buffers live in C++; its logging data reports their sizes in bytes.
        buckets = sum(
            int(s) for s in ddp._get_ddp_logging_data().get("bucket_sizes", "").split(", ") if s
        )
        return (
            tensor_mb([*model.parameters(), *optimizer_tensors(opt)])
            + buckets / 2**20
            + grad_mb(model)
        )

    return Contender("torch DDP", step, state_mb)


def build_deepspeed(args: argparse.Namespace, deepspeed: object) -> Contender:
    model = make_model(args)
    opt = adamw(model)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0 now; ours and DDP's is off
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,  # a plain torch AdamW, the same as the others'
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    def state_mb() -> float:
        # Gradients are freed after each step and rebuilt in backward; its flat all-reduce
        # buffer is a temporary of the same size, not counted (not persistent).
        return tensor_mb([*model.parameters(), *optimizer_tensors(opt)]) + grad_mb(model)

    return Contender(f"DeepSpeed {deepspeed.__version__}", step, state_mb)


def run_block(c: Contender, batches: list, warmup: int, steps: int) -> None:
    """``warmup`` untimed then ``steps`` timed steps of ``c``, each rank on its rows."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(i: int) -> torch.Tensor:
        x, y = batches[i]
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        return c.step(x[rows], y[rows])

    timed_steps(c, step, warmup, steps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument(
        "--bucket-elements",
        type=int,
        default=None,
        help="our zero_optimization.reduce_bucket_size (default: shardwise's own)",
    )
    p.add_argument("--skip-deepspeed", action="store_true", help="only ours vs DDP")
    p.add_argument(
        "--diagnostics-off-row",
        action="store_true",
        help="add our engine with the flight recorder off: what the default diagnostics cost",
    )
    return p.parse_args(argv)


def build_all(args: argparse.Namespace) -> tuple[list[Contender], str]:
    contenders = [build_ours(args), build_ddp(args)]
    if args.diagnostics_off_row:
        contenders.append(build_ours(args, diagnostics=False))
    note = ""
    if args.skip_deepspeed:
        note = "DeepSpeed skipped: --skip-deepspeed"
    else:
        ds, why = import_deepspeed()
        if ds is None:
            note = f"DeepSpeed skipped: cannot import it ({why}); pip install -e '.[bench]'"
        else:
            contenders.append(build_deepspeed(args, ds))
    return contenders, note


LEGEND = """\
ours/peer <= 1.00: shardwise is as fast or faster. ms: wall time of the slowest rank. CPU ms:
CPU time of all the slowest rank's threads (gloo's too), nearly blind to other load on the
machine. state: params + grads (counted also when rebuilt every step) + optimizer state +
persistent comm buckets (ours hold the grads; DDP's live in C++ beside them).
max |loss - ours|: over every step's loss (mean over ranks)."""


def _row(c: Contender, ours: Contender) -> tuple[list[str], float]:
    """One table row, and the largest loss difference from ours over all steps."""
    med, cpu = median_ms(c.times), median_ms(c.cpu)
    worst = max(abs(a - b) for a, b in zip(c.losses, ours.losses, strict=True))
    cells = [
        c.name,
        f"{med:.1f}",
        f"{1e3 * min(c.times):.1f}",
        f"{median_ms(ours.times) / med:.3f}",
    ]
    cells += [f"{cpu:.1f}", f"{median_ms(ours.cpu) / cpu:.3f}", f"{c.state_mb():.0f}"]
    return [*cells, f"{c.losses[-1]:.4f}", f"{worst:.1e}"], worst


def report(args: argparse.Namespace, contenders: list[Contender], note: str) -> None:
    ours = contenders[0]
    print(
        f"\nDP benchmark: GPT {args.layers}x{args.d_model}, seq {args.seq}, "
        f"{n_params(make_model(args)) / 1e6:.1f}M params; {dist.get_world_size()} ranks x "
        f"micro-batch {args.micro_batch}, gloo, 1 thread/rank; {args.rounds} rounds x "
        f"({args.warmup} warm-up + {args.steps} timed) steps each; AdamW lr {LR}\n"
    )
    headers = ["contender", "median ms", "min ms", "ours/peer", "CPU ms", "CPU ours/peer"]
    headers += ["state MiB", "final loss", "max |loss - ours|"]
    rows = [_row(c, ours) for c in contenders]
    print(format_table(headers, [cells for cells, _ in rows]))
    print(f"\n{LEGEND}")
    print(
        f"loss {ours.losses[0]:.4f} -> {ours.losses[-1]:.4f} over {len(ours.losses)} steps; ",
        end="",
    )
    if max(worst for _, worst in rows) <= LOSS_TOLERANCE:
        print(f"every contender's losses agree within {LOSS_TOLERANCE:g}")
    else:
        print(f"WARNING: losses differ by > {LOSS_TOLERANCE:g}: the timings are not comparable")
    print(f"load average (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if note:
        print(note)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    single_thread()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    contenders, note = build_all(args)
    batches = make_batches(
        args.rounds * (args.warmup + args.steps), args.micro_batch * dist.get_world_size(), args.seq
    )
    for r in range(args.rounds):
        for c in contenders:
            run_block(c, batches, args.warmup, args.steps)
        if rank == 0:
            done = ", ".join(
                f"{c.name} {median_ms(c.times[-args.steps :]):.0f} ms" for c in contenders
            )
            print(f"round {r + 1}/{args.rounds}: {done}", flush=True)
    spread = torch.tensor([rss_mb()])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    if rank == 0:
        report(args, contenders, note)
        print(f"peak RSS of the busiest rank (all contenders together): {spread.item():.0f} MiB")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
