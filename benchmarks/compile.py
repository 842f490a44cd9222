"""torch.compile per block, side by side: shardwise DP / ZeRO-3 / TP vs FSDP2, eager and compiled.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/compile.py

One launch, one gloo world, one thread per rank. The GPT of examples/gpt/model.py, built from
the same seeded weights for every contender, trained with the same torch AdamW:

    ours dp2          shardwise.initialize, plain data parallelism
    ours zero3x2      ZeRO-3 (zero_optimization.stage 3)
    ours tp2          tensor_parallel.size 2, the blocks-only plan (every rank: the whole batch)
    ours cp2 ring     context_parallel.size 2, ring attention (every rank: half of each sequence)
    ours ep2 (MoE)    each block's feed-forward a MoE of 4 MLPs, 2 per rank (its own model: a
                      family of its own, beside the others, not comparable with them)
    fsdp2             torch's fully_shard on each block, then on the model (torchtitan's order)

each eager and compiled: ours with ``"compile": {"enabled": true, "backend": B}`` (the whole
model one region for DP, each block's forward for ZeRO-3 and TP, docs/compile.md), FSDP2 with each block replaced by ``torch.compile(block)``
before ``fully_shard`` (torchtitan's ``apply_compile``). A contender's first step compiles
(its warmup, untimed); rounds interleave the contenders; a step (forward, backward, AdamW
step, zeroing) costs what the slowest rank took; figures are medians. Printed per family: the
step time eager and compiled, the speedup (eager / compiled), and for compiled contenders the
graph breaks and the graphs compiled after the first step (recompiles), from dynamo's
counters. Eager and compiled runs of one family must agree on the losses (LOSS_TOLERANCE).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # run as a script: find common.py
from common import (  # noqa: E402
    add_model_args,
    format_table,
    make_batches,
    median_ms,
    single_thread,
    timed_steps,  # noqa: E402
)
from tp_vs_torch import BLOCKS_PLAN, GPT_MODULE  # noqa: E402

import shardwise  # noqa: E402

LR = 1e-3
# Inductor fuses and reorders sums inside a block: eager and compiled losses of one family
# differ by rounding, about 1e-6 relative per step; a broken contender is off by far more.
LOSS_TOLERANCE = 1e-3
# A MoE gate's top-1 choice is discontinuous: a rounding difference in a logit near a tie sends
# a token to another expert (or past its capacity), and from then on the two runs train
# different models. At 4x256 over 6 rounds, eager and compiled agreed to 1e-7 for 9 steps, then
# 2.6e-5 at step 9 and a chaotic 1.5e-2 by step 25. The MoE family's losses are compared over
# its first steps (tests/test_compile.py holds ep2 to 1e-5 of one process over 6 steps).
MOE_CHECKED_STEPS = 8
# The MoE family: 4 experts, 2 per rank. Without DeepSpeed's random token selection (use_rts,
# on by default): it draws from the global generator, which the interleaved contenders share,
# so eager and compiled dropped different tokens (losses 5e-3 apart; without it, 2e-7).
MOE = {"moe_experts": 4, "ep": 2, "moe_args": {"use_rts": False}}


@dataclass
class Contender:
    name: str
    family: str
    compiled: bool
    step: Callable[[int], torch.Tensor]
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    steps_done: int = 0
    breaks: int = 0
    graphs_after_first: int = 0
    graphs_total: int = 0


def make_gpt(args: argparse.Namespace, **moe: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = GPT_MODULE.GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.d_model,
        **moe,  # moe_experts, ep: the MoE family's feed-forward
    )
    return GPT_MODULE.GPT(cfg)


def ours(args: argparse.Namespace, layout: dict, backend: str | None, batches: list) -> Callable:
    moe = layout.pop("moe", {})
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        **layout,
    }
    if backend:
        config["compile"] = {"enabled": True, "backend": backend}
    engine, *_ = shardwise.initialize(model=make_gpt(args, **moe), config=config)
    # TP and CP: every rank trains the whole batch (CP: the engine cuts the sequence)
    whole = "tensor_parallel" in layout or "context_parallel" in layout

    def step(i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        if not whole:
            rows = slice(
                dist.get_rank() * args.micro_batch, (dist.get_rank() + 1) * args.micro_batch
            )
            x, y = x[rows], y[rows]
        if "context_parallel" in layout:  # this rank's tokens of each sequence
            x, y = engine.shard_sequence(x), engine.shard_sequence(y)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


def fsdp2(args: argparse.Namespace, backend: str | None, batches: list) -> Callable:
    model = make_gpt(args)
    for i, block in enumerate(model.blocks):
        if backend:
            block = torch.compile(block, backend=backend)
            model.blocks.register_module(str(i), block)
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        rows = slice(dist.get_rank() * args.micro_batch, (dist.get_rank() + 1) * args.micro_batch)
        loss = model(x[rows], y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def contenders(args: argparse.Namespace, batches: list) -> list[Contender]:
    families = {
        "ours dp2": lambda b: ours(args, {}, b, batches),
        "ours zero3x2": lambda b: ours(args, {"zero_optimization": {"stage": 3}}, b, batches),
        "ours tp2": lambda b: ours(
            args, {"tensor_parallel": {"size": 2, "plan": BLOCKS_PLAN}}, b, batches
        ),
        "ours cp2 ring": lambda b: ours(args, {"context_parallel": {"size": 2}}, b, batches),
        "ours ep2 (MoE)": lambda b: ours(args, {"moe": MOE}, b, batches),
        "fsdp2": lambda b: fsdp2(args, b, batches),
    }
    families = {k: v for k, v in families.items() if not args.only or k in args.only.split(",")}
    out = []
    for family, build in families.items():
        out.append(Contender(f"{family} eager", family, False, build(None)))
        out.append(Contender(f"{family} compiled", family, True, build(args.backend)))
    return out


def run_round(c: Contender, args: argparse.Namespace, first: bool) -> None:
    before = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    timed_steps(c, c.step, args.warmup if first else 0, args.steps)
    if c.compiled:
        c.breaks += sum(counters["graph_break"].values()) - breaks
        grown = counters["stats"]["unique_graphs"] - before
        c.graphs_total += grown
        if not first:
            c.graphs_after_first += grown


def report(cs: list[Contender], args: argparse.Namespace) -> str:
    rows = []
    for eager, comp in zip(cs[::2], cs[1::2], strict=True):
        te, tc = median_ms(eager.times), median_ms(comp.times)
        ce, cc = median_ms(eager.cpu), median_ms(comp.cpu)
        pairs = list(zip(eager.losses, comp.losses, strict=True))
        pairs = pairs[:MOE_CHECKED_STEPS] if "MoE" in eager.family else pairs
        diff = max(abs(a - b) / abs(a) for a, b in pairs)
        ok = "ok" if diff <= LOSS_TOLERANCE else f"DIFFERS {diff:.1e}"
        rows.append(
            [eager.family, f"{te:.1f}", f"{tc:.1f}", f"{te / tc:.2f}x", f"{ce:.1f}", f"{cc:.1f}",
             str(comp.breaks), str(comp.graphs_total), str(comp.graphs_after_first), ok]
        )  # fmt: skip
    head = ["family", "eager ms", "compiled ms", "speedup", "eager CPU ms", "compiled CPU ms"]
    return format_table(head + ["graph breaks", "graphs", "recompiles", "losses"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.set_defaults(d_model=128, layers=4, seq=64, micro_batch=4, rounds=3, steps=4, warmup=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--only", default="", help='families to run, comma-separated ("fsdp2,ours dp2")')
    args = p.parse_args()
    single_thread()
    # Every contender compiles the same GPT code (examples/gpt/model.py). Left automatic,
    # dynamo takes a contender whose input shape differs from an earlier contender's (CP's
    # half sequences after DP's rows: "size mismatch at index 0") for a shape that varies and
    # compiles it shape-generic, slower than the static graph it gets alone (CP at 4x256:
    # 0.87x after three families, 1.04x alone). Off, each contender compiles for its own
    # shapes, as in a process of its own.
    torch._dynamo.config.automatic_dynamic_shapes = False
    shardwise.init_distributed()
    if dist.get_world_size() != 2:
        raise SystemExit("run on 2 processes: --nproc-per-node 2")
    batches = make_batches(args.rounds * args.steps + args.warmup, 2 * args.micro_batch, args.seq, args.vocab)  # fmt: skip
    cs = contenders(args, batches)
    for r in range(args.rounds):
        for c in cs:
            run_round(c, args, first=r == 0)
    if dist.get_rank() == 0:
        print(
            f"\ncompile benchmark: examples/gpt GPT {args.layers}x{args.d_model} ({args.heads} "
            f"heads), seq {args.seq}, {args.micro_batch} rows per rank, backend {args.backend}, "
            f"{args.rounds} rounds x {args.steps} steps, medians\n"
        )
        print(report(cs, args))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
