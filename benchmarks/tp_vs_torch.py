"""Tensor parallelism, side by side: shardwise TP vs torch's ``parallelize_module`` (DTensor).

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp_vs_torch.py

One launch, one gloo world (every rank is one tensor-parallel rank), one thread per rank. The
GPT of examples/gpt/model.py (separate q/k/v, so a column split hands each rank whole heads),
built in the same processes from the same seeded weights, trained on the same batches (every
rank sees the whole batch: TP splits the layers, not the data) with the same torch AdamW:

    ours, blocks        shardwise.initialize, tensor_parallel.size N, blocks-only plan: q, k, v,
                        mlp.fc colwise; attn.proj, mlp.proj rowwise; the rest replicated
    torch, blocks       parallelize_module on DeviceMesh("cpu", (N,)), the same plan with
                        ColwiseParallel / RowwiseParallel (local tensors out: attention runs on
                        local heads, inferred from the weight size)
    ours, full plan     the model's tp_plan: also the embedding, the head and the loss split by
                        vocabulary (vocab-parallel cross-entropy, logits never gathered)
    torch, full plan    + RowwiseParallel(input_layouts=Replicate()) on the embedding,
                        ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) on
                        the head, forward and backward inside loss_parallel()

Rounds interleave them; a step (forward, backward, AdamW step, zeroing) is timed between two
barriers and costs what the SLOWEST rank took (wall and CPU time); figures are medians. After
the rounds, one more step per contender (untimed) counts its collectives and their bytes with
CommDebugMode's rule (CollectiveBytes below), checked against shardwise.comm.stats() for ours
and against CommDebugMode itself for torch's. Every contender must have produced the same
losses: a benchmark of a broken engine is worthless.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # run as a script: find common.py
from common import (  # noqa: E402
    add_model_args,
    format_table,
    make_batches,
    median_ms,
    single_thread,
    timed_steps,
)

LR, WEIGHT_DECAY = 1e-3, 0.01
# Same weights, data and fp32 math; the plans differ only in where partial sums are added
# (and the vocab-parallel loss sums exp over two halves): a few ulps per step. A contender
# that trained something else is off by far more.
LOSS_TOLERANCE = 1e-4
# The blocks-only plan, in our style names; torch's is built from the same table.
BLOCKS_PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
}
KINDS = {  # collective name (underscores dropped) contains -> the kind reported
    "reducescatter": "reduce_scatter",
    "allgather": "all_gather",
    "allreduce": "all_reduce",
    "broadcast": "broadcast",
    "alltoall": "all_to_all",
}


def load_example_gpt() -> object:
    """examples/gpt/model.py as a module (a unique name: other examples have a model.py too)."""
    spec = importlib.util.spec_from_file_location(
        "example_gpt_model", HERE.parent / "examples" / "gpt" / "model.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


GPT_MODULE = load_example_gpt()


@dataclass
class Contender:
    """A name, its peer's name, a training step on the whole batch (returns the loss)."""

    name: str
    peer: str | None
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    times: list[float] = field(default_factory=list)  # seconds, slowest rank, timed steps
    cpu: list[float] = field(default_factory=list)  # CPU seconds, slowest rank
    losses: list[float] = field(default_factory=list)  # mean over ranks, every step
    steps_done: int = 0
    comm: dict[str, list[int]] = field(default_factory=dict)  # kind -> [calls, payload bytes]
    check: str = ""  # the counts of that step against a second counter


def make_gpt(args: argparse.Namespace) -> torch.nn.Module:
    """The same initial weights for every contender: the seed alone decides them."""
    torch.manual_seed(0)
    cfg = GPT_MODULE.GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.d_model,
    )
    return GPT_MODULE.GPT(cfg)


def adamw(params: object) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def build_ours(args: argparse.Namespace, plan: dict[str, str] | None, name: str) -> Contender:
    import shardwise

    tp: dict = {"size": dist.get_world_size()}
    if plan is not None:
        tp["plan"] = plan
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "tensor_parallel": tp,
        "steps_per_print": 10**9,  # no progress lines between the round reports
    }
    # A callable, not an AdamW instance: TP replaces the split layers' parameters, and the
    # optimizer must hold the new (local) ones.
    engine, *_ = shardwise.initialize(model=make_gpt(args), optimizer=adamw, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return Contender(name, None, step)


def torch_plan(full: bool) -> dict[str, object]:
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan: dict[str, object] = {k: styles[v]() for k, v in BLOCKS_PLAN.items()}
    if full:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())  # rows = vocabulary
        plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def build_torch(args: argparse.Namespace, mesh: DeviceMesh, full: bool, peer: str) -> Contender:
    model = parallelize_module(make_gpt(args), mesh, torch_plan(full))
    opt = adamw(model.parameters())  # after parallelize_module: over the DTensor parameters
    # The loss (nn.CrossEntropyLoss inside the model) takes DTensor logits split along the
    # vocabulary; loss_parallel() must cover forward and backward.
    scope = loss_parallel if full else contextlib.nullcontext

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with scope():
            loss = model(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()  # set_to_none, torch's default
        return loss.to_local() if isinstance(loss, DTensor) else loss

    name = "torch TP, full plan" if full else "torch TP, blocks"
    return Contender(name, peer, step)


class CollectiveBytes(TorchDispatchMode):
    """Counts collectives and adds up their payload bytes, by kind.

    CommDebugMode's rule (DTensor ops lowered to local ops first, then every collective of
    torch.distributed or its functional API counted), without its module tracker: that one
    registers full backward hooks, which hand q, k and v each their own alias of the input and
    so make our shared f (one all-reduce for the three) run three times. Payload: the largest
    tensor of the call (shardwise.comm's convention: the all-reduced tensor, the gathered
    output, the reduce-scattered input).
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns it into local ops and collectives, seen here
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__.replace("_", "")
        kind = next((k for key, k in KINDS.items() if key in name), None)
        if kind is not None and "c10d" in func.namespace:
            leaves = tree_leaves((args, kwargs, out))
            sizes = [t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)]
            self.by_kind[kind][0] += 1
            self.by_kind[kind][1] += max(sizes, default=0)
        return out


def run_block(c: Contender, batches: list, warmup: int, steps: int) -> None:
    """``warmup`` untimed then ``steps`` timed steps of ``c``, continuing its batch sequence
    (the whole batch on every rank)."""
    timed_steps(c, lambda i: c.step(*batches[i]), warmup, steps)


def count_step(c: Contender, batches: list) -> None:
    """One more step (untimed; its loss recorded) under CollectiveBytes: the collectives and
    bytes of one step, checked against shardwise.comm.stats() (ours) or CommDebugMode (torch's)."""
    from shardwise import comm

    x, y = batches[c.steps_done]
    comm.reset_stats()
    debug = CommDebugMode() if c.peer is not None else contextlib.nullcontext()
    with warnings.catch_warnings():
        # CommDebugMode's module tracker warns that the first layer's inputs need no grad.
        warnings.simplefilter("ignore", UserWarning)
        with debug, CollectiveBytes() as mode:
            loss = c.step(x, y)
    dist.barrier()
    c.comm = dict(mode.by_kind)
    calls = sum(n for n, _ in c.comm.values())
    if c.peer is None:
        got = {k: [v["calls"], v["bytes"]] for k, v in comm.stats().items() if k != "barrier"}
        c.check = f"shardwise.comm.stats() {got}: " + ("agree" if got == c.comm else "DISAGREE")
    else:
        total = debug.get_total_counts()
        c.check = f"CommDebugMode {total} collectives: " + (
            "agree" if total == calls else "DISAGREE"
        )
    c.check = f"{c.name}: counted {c.comm}; {c.check}"
    mean = loss.detach().double().reshape(1)
    dist.all_reduce(mean)
    c.losses.append(mean.item() / dist.get_world_size())
    c.steps_done += 1


def sent_bytes(c: Contender, n: int) -> float:
    """Bytes one rank sends per step under the ring model (shardwise.comm's convention)."""
    factor = {"all_reduce": 2 * (n - 1) / n}
    return sum(factor.get(k, (n - 1) / n) * b for k, (_, b) in c.comm.items())


def table_row(c: Contender, by_name: dict[str, Contender], ref: Contender) -> list[str]:
    med, cpu = median_ms(c.times), median_ms(c.cpu)
    worst = max(abs(a - b) for a, b in zip(c.losses, ref.losses, strict=True))
    ours = by_name.get(c.peer) if c.peer else None
    wall_ratio = f"{median_ms(ours.times) / med:.3f}" if ours else "-"
    cpu_ratio = f"{median_ms(ours.cpu) / cpu:.3f}" if ours else "-"
    calls = " + ".join(f"{n} {k}" for k, (n, _) in sorted(c.comm.items())) or "0"
    payload = sum(b for _, b in c.comm.values())
    sent = sent_bytes(c, dist.get_world_size())
    cells = [c.name, f"{med:.1f}", f"{1e3 * min(c.times):.1f}", f"{cpu:.1f}"]
    cells += [wall_ratio, cpu_ratio, calls, f"{payload / 2**20:.2f}", f"{sent / 2**20:.2f}"]
    return [*cells, f"{worst:.1e}"]


def report(args: argparse.Namespace, contenders: list[Contender], note: str) -> None:
    by_name = {c.name: c for c in contenders}
    ref = contenders[0]
    n = dist.get_world_size()
    params = sum(p.numel() for p in make_gpt(args).parameters())
    print(
        f"\nTP benchmark: examples/gpt GPT {args.layers}x{args.d_model} ({args.heads} heads), "
        f"vocab {args.vocab}, seq {args.seq}, {params / 1e6:.2f}M params; TP {n} (gloo, 1 "
        f"thread/rank), batch {args.micro_batch} rows on every rank; {args.rounds} rounds x "
        f"({args.warmup} warm-up + {args.steps} timed) steps; AdamW lr {LR}\n"
    )
    headers = ["contender", "median ms", "min ms", "CPU ms", "ours/this wall", "ours/this CPU"]
    headers += ["collectives/step", "payload MiB", "sent MiB/rank", "max |loss - ours blocks|"]
    print(format_table(headers, [table_row(c, by_name, ref) for c in contenders]))
    print(f"\n{LEGEND}")
    worst = max(abs(a - b) for c in contenders for a, b in zip(c.losses, ref.losses, strict=True))
    print(
        f"loss {ref.losses[0]:.4f} -> {ref.losses[-1]:.4f} over {len(ref.losses)} steps; ", end=""
    )
    if worst <= LOSS_TOLERANCE:
        print(f"every contender's losses agree within {LOSS_TOLERANCE:g}")
    else:
        print(f"WARNING: losses differ by {worst:.1e} > {LOSS_TOLERANCE:g}: not comparable")
    for c in contenders:
        print(c.check)
    print(f"load average (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if note:
        print(note)


LEGEND = """\
ours/this: our contender with the same plan divided by this one (<= 1.00: shardwise is as fast
or faster). ms: wall time of the slowest rank; CPU ms: CPU time of all its threads (gloo's
too), nearly blind to other load on the machine. collectives/step, payload: one more step,
counted by CommDebugMode's rule; payload = all-reduced tensors, gathered outputs,
reduce-scattered inputs; sent = bytes per rank under the ring model (all-reduce 2(N-1)/N,
others (N-1)/N of the payload)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(d_model=256, layers=4, micro_batch=8, rounds=8)
    p.add_argument("--heads", type=int, default=None, help="attention heads (d_model / 64)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--skip-full", action="store_true", help="blocks-only plans only")
    args = p.parse_args(argv)
    args.heads = args.heads or max(1, args.d_model // 64)
    return args


def build_all(args: argparse.Namespace) -> list[Contender]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = [build_ours(args, BLOCKS_PLAN, "shardwise TP, blocks")]
    out.append(build_torch(args, mesh, False, peer=out[0].name))
    if not args.skip_full:
        out.append(build_ours(args, None, "shardwise TP, full plan"))
        out.append(build_torch(args, mesh, True, peer=out[2].name))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    single_thread()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    contenders = build_all(args)
    n_steps = args.rounds * (args.warmup + args.steps) + 1  # + the counted step
    batches = make_batches(n_steps, args.micro_batch, args.seq, vocab=args.vocab)
    for r in range(args.rounds):
        for c in contenders:
            run_block(c, batches, args.warmup, args.steps)
        if rank == 0:
            done = ", ".join(
                f"{c.name} {median_ms(c.times[-args.steps :]):.0f} ms" for c in contenders
            )
            print(f"round {r + 1}/{args.rounds}: {done}", flush=True)
    for c in contenders:
        count_step(c, batches)
    if rank == 0:
        note = "torch full plan skipped: --skip-full" if args.skip_full else ""
        report(args, contenders, note)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
