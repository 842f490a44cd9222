"""Pipeline parallelism, side by side: shardwise's schedules vs torch.distributed.pipelining's.

    python -m shardwise run --nproc-per-node 2 benchmarks/pp_vs_torch.py [--zero-bubble]

One launch, 2 processes = 2 stages, gloo, one thread each. Both contenders get the same split
of common.py's GPT (head untied: a tie across stages is a feature torch's stages lack) as the
same list of layers, [embeddings, block 0, ..., block L-1, final norm + head], cut where our
partition cuts it (``type:Block``: half the blocks per stage), from the same seeded weights,
with the same torch AdamW, on the same micro-batches:

    ours   shardwise.pipe.PipelineModule, engine.train_batch (schedule "1f1b")
    torch  PipelineStage + Schedule1F1B(n_microbatches=m), then opt.step() / zero_grad()

With --zero-bubble six more (issue 29): ours "zb-h1" and "zbv" (two chunks per stage in a V,
cut by the same ``type:Block`` partition into 4 virtual stages), torch's
ScheduleInterleavedZeroBubble (one stage per rank: ZB1P, the same algorithm as ZB-H1) and
ScheduleZBVZeroBubble (the same 4 virtual stages, rank 0 holding stages 0 and 3), and ours
"dualpipev" against torch's ScheduleDualPipeV on those same 4 virtual stages (DeepSeek's
DualPipeV: F&B steps pairing one chunk's forward with the other's backward). After the
timed rounds one more step of each runs with a saved-tensor meter on (outside the timing: it
costs a Python call per saved tensor): the peak activation bytes the slowest-memory rank held
(parallel/pipeline/meter.py; ours also books what B keeps for W, each linear's input and output
gradient; torch's ZB keeps its autograd graph until W, which the meter sees as saved tensors).

A step is one global batch of m micro-batches (forwards, backwards, point-to-point, optimizer
step on each stage); the batch is chunked into micro-batches the same way for both (torch's
tensor_split along rows). Rounds interleave the two contenders; each step is timed between
two barriers, costs what the slowest rank took, and the figure is the median (dp.py's rules).
Every step's loss (mean over the micro-batches, from the last stage) is compared.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common.py
from common import (  # noqa: E402
    add_model_args,
    format_table,
    make_batches,
    make_model,
    median_ms,
    n_params,
    single_thread,
    timed_steps,
)

import shardwise  # noqa: E402
from shardwise.parallel.pipeline.meter import ActivationMeter  # noqa: E402
from shardwise.pipe import PipelineModule  # noqa: E402

LR, WEIGHT_DECAY = 1e-3, 0.01
LOSS_TOLERANCE = 1e-4  # same weights, data and fp32 math; only the order of additions differs


class Embed(nn.Module):
    """idx (B, T) -> token + position embeddings (B, T, C)."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx_bt: torch.Tensor) -> torch.Tensor:
        return self.tok(idx_bt) + self.pos(torch.arange(idx_bt.shape[1]))


class Final(nn.Module):
    """(B, T, C) -> logits (B, T, V): final LayerNorm, then the head."""

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x_btc: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x_btc))


def lm_loss(logits_btv: torch.Tensor, targets_bt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_btv.flatten(0, 1), targets_bt.flatten())


def gpt_layers(args: argparse.Namespace) -> list[nn.Module]:
    """common.py's GPT as a layer list; the head gets its own copy of the embedding's weights."""
    gpt = make_model(args)
    head = nn.Linear(args.d_model, gpt.tok.num_embeddings, bias=False)
    head.weight = nn.Parameter(gpt.tok.weight.detach().clone())
    return [Embed(gpt.tok, gpt.pos), *gpt.blocks, Final(gpt.ln_f, head)]


@dataclass
class Contender:
    """A name and a training step on one global batch (returns the mean loss on every rank)."""

    name: str
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    steps_done: int = 0
    loss_rank: int = 1  # the rank that computes the loss (0 in a V: stage 0 holds the last layer)
    schedule: str = "1f1b"
    measure: Callable[[torch.Tensor, torch.Tensor], int] | None = None  # a step's peak bytes
    peak: int = 0


V_SHAPED = ("zbv", "dualpipev")  # two chunks per stage, stage 0 holding the first and the last


def build_ours(args: argparse.Namespace, schedule: str = "1f1b") -> tuple[Contender, list[int]]:
    v_shape = schedule in V_SHAPED
    net = PipelineModule(
        gpt_layers(args),
        num_stages=2,
        loss_fn=lm_loss,
        partition_method="type:Block",
        chunks=2 if v_shape else None,
        placement="v" if v_shape else None,
    )
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.micro_batches,
        "gradient_clipping": 0.0,
        "pipeline": {"schedule": schedule, "chunks": 2 if v_shape else 1},
    }
    engine, *_ = shardwise.initialize(model=net, optimizer=opt, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        chunks = zip(
            x.tensor_split(args.micro_batches), y.tensor_split(args.micro_batches), strict=True
        )
        return engine.train_batch(iter(list(chunks)))

    def measure(x: torch.Tensor, y: torch.Tensor) -> int:
        engine.pipeline.track_activations()
        step(x, y)
        peak = engine.pipeline.peak_activation_bytes
        engine.pipeline.track_activations(False)
        return peak

    name = {"1f1b": "1F1B", "zb-h1": "ZB-H1", "zbv": "ZBV", "dualpipev": "DualPipeV"}[schedule]
    loss_rank = 0 if v_shape else 1
    c = Contender(f"shardwise {name}", step, loss_rank=loss_rank, measure=measure)
    c.schedule = schedule
    return c, list(net.parts)


TORCH_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def build_torch(args: argparse.Namespace, parts: list[int], schedule: str = "1f1b") -> Contender:
    """torch's stages over our cut ``parts`` (4 virtual stages for zbv and dualpipev, rank r
    holding r and 3 - r), and torch's schedule of the same name."""
    import torch.distributed.pipelining as pipelining

    rank, v_shape = dist.get_rank(), schedule in V_SHAPED
    layers = gpt_layers(args)
    indices = [rank, 3 - rank] if v_shape else [rank]
    modules = [nn.Sequential(*layers[parts[w] : parts[w + 1]]) for w in indices]
    stages = [
        pipelining.PipelineStage(m, w, len(parts) - 1, torch.device("cpu"))
        for m, w in zip(modules, indices, strict=True)
    ]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    one = stages[0] if schedule == "1f1b" else stages  # the multi-stage schedules take a list
    sched = cls(one, n_microbatches=args.micro_batches, loss_fn=lm_loss)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    loss_rank = 0 if v_shape else 1

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": losses} if rank == loss_rank else {}
        sched.step(*([x] if rank == 0 else []), **kwargs)
        opt.step()
        opt.zero_grad()  # set_to_none, torch's default
        return torch.stack(losses).mean() if losses else torch.zeros(())

    meter = ActivationMeter(nn.ModuleList(modules))  # parameters of both chunks left out

    def measure(x: torch.Tensor, y: torch.Tensor) -> int:
        meter.live = meter.peak = 0
        with meter.hooks():
            step(x, y)
        return meter.peak

    name = f"torch {TORCH_SCHEDULES[schedule]}"
    return Contender(name, step, loss_rank=loss_rank, measure=measure, schedule=schedule)


def run_block(c: Contender, batches: list, warmup: int, steps: int) -> None:
    """``warmup`` untimed then ``steps`` timed steps of ``c``, continuing its batch sequence;
    the recorded loss is the rank's that computes it."""
    mine = dist.get_rank() == c.loss_rank

    def step(i: int) -> torch.Tensor:
        loss = c.step(*batches[i])
        return loss if mine else torch.zeros((), dtype=torch.float64)

    timed_steps(c, step, warmup, steps, loss_over_ranks="sum")


def report(args: argparse.Namespace, contenders: list[Contender], parts: list[int]) -> None:
    ours = contenders[0]
    print(
        f"\nPP benchmark: GPT {args.layers}x{args.d_model}, seq {args.seq}, "
        f"{n_params(make_model(args)) / 1e6:.1f}M params (+ the untied head); 2 stages "
        f"(layers {parts[0]}-{parts[1] - 1} | {parts[1]}-{parts[2] - 1} of embed, "
        f"{args.layers} blocks, head), gloo, 1 thread/rank; m = {args.micro_batches} "
        f"micro-batches of {args.micro_batch} rows; {args.rounds} rounds x ({args.warmup} "
        f"warm-up + {args.steps} timed) steps each; AdamW lr {LR}\n"
    )
    headers = ["contender", "median ms", "min ms", "1F1B/this", "ours/torch", "CPU ms"]
    headers += ["final loss", "max |loss - ours|", "peak act MB"]
    ours_of = {c.schedule: c for c in contenders if c.name.startswith("shardwise")}
    rows, worst = [], 0.0
    for c in contenders:
        med, cpu = median_ms(c.times), median_ms(c.cpu)
        diff = max(abs(a - b) for a, b in zip(c.losses, ours.losses, strict=True))
        worst = max(worst, diff)
        twin = ours_of[c.schedule]
        rows.append(
            [c.name, f"{med:.1f}", f"{1e3 * min(c.times):.1f}"]
            + [f"{median_ms(ours.times) / med:.3f}"]
            + [f"{median_ms(twin.times) / med:.3f}" if twin is not c else "-", f"{cpu:.1f}"]
            + [f"{c.losses[-1]:.4f}", f"{diff:.1e}", f"{c.peak / 2**20:.1f}" if c.peak else "-"]
        )
    print(format_table(headers, rows))
    print(
        "\nms: wall time of a step (m micro-batches + optimizer), slowest rank; CPU ms: CPU "
        "time of all its threads; 1F1B/this > 1: faster than shardwise 1F1B; ours/torch <= "
        "1.00: shardwise's schedule as fast as torch's or faster; peak act MB: saved-tensor "
        "bytes at the peak of one more step, the rank holding most."
    )
    print(f"loss {ours.losses[0]:.4f} -> {ours.losses[-1]:.4f} over {len(ours.losses)} steps; ")
    if worst <= LOSS_TOLERANCE:
        print(f"every contender's losses agree within {LOSS_TOLERANCE:g}")
    else:
        print(f"WARNING: losses differ by > {LOSS_TOLERANCE:g}: the timings are not comparable")
    print(f"load average (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--micro-batches", type=int, default=8, help="m per step (>= 2 for torch)")
    p.add_argument(
        "--zero-bubble",
        action="store_true",
        help="also ZB-H1, ZBV and DualPipeV, ours and torch's (ScheduleInterleavedZeroBubble, "
        "ScheduleZBVZeroBubble, ScheduleDualPipeV)",
    )
    p.set_defaults(micro_batch=2)
    return p.parse_args(argv)


def contenders_for(args: argparse.Namespace) -> tuple[list[Contender], list[int]]:
    ours, parts = build_ours(args)
    out = [ours, build_torch(args, parts)]
    if args.zero_bubble:
        zb, _ = build_ours(args, "zb-h1")
        zbv, v_parts = build_ours(args, "zbv")
        out += [zb, build_torch(args, parts, "zb-h1"), zbv, build_torch(args, v_parts, "zbv")]
        dual, _ = build_ours(args, "dualpipev")  # the same V cut as zbv's
        out += [dual, build_torch(args, v_parts, "dualpipev")]
    return out, parts


def measure_peaks(contenders: list[Contender], batches: list) -> None:
    """One more step of each with the saved-tensor meter on; the largest rank's peak."""
    for c in contenders:
        peak = torch.tensor([c.measure(*batches[c.steps_done]) if c.measure else 0])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        c.peak = int(peak.item())
        c.steps_done += 1


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    single_thread()
    logging.getLogger("shardwise").addHandler(logging.NullHandler())  # no start-up log lines
    # torch's stages call dist.batch_isend_irecv: under the cover (diagnose/interpose.py) our
    # flight recorder would book each of their sends, a cost torch alone does not pay.
    os.environ.setdefault("SHARDWISE_COVER_TORCH_DISTRIBUTED", "0")
    shardwise.init_distributed()
    if dist.get_world_size() != 2:
        raise SystemExit(
            f"pp_vs_torch.py runs 2 stages: launch 2 processes, not {dist.get_world_size()}"
        )
    contenders, parts = contenders_for(args)
    rows = args.micro_batch * args.micro_batches
    batches = make_batches(args.rounds * (args.warmup + args.steps) + 1, rows, args.seq)
    for r in range(args.rounds):
        for c in contenders:
            run_block(c, batches, args.warmup, args.steps)
        if dist.get_rank() == 0:
            done = ", ".join(
                f"{c.name} {median_ms(c.times[-args.steps :]):.0f} ms" for c in contenders
            )
            print(f"round {r + 1}/{args.rounds}: {done}", flush=True)
    measure_peaks(contenders, batches)
    if dist.get_rank() == 0:
        report(args, contenders, parts)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
