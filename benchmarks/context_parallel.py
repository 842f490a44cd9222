"""Context parallelism (issue 18): activation bytes, step time and traffic per rank, cp 1, 2, 4.

    python benchmarks/context_parallel.py                   # the driver: worlds 1, 2, 4 in turn
    python -m shardwise run --nproc-per-node 2 benchmarks/context_parallel.py --cp 2 --out r.json

The driver launches one world per context size, one after the other (a single process for cp 1,
the single-process reference; ``python -m shardwise run --nproc-per-node N`` for cp N), each
writing its figures to a JSON file, then prints the tables. Every world is one context group
(no data parallelism), gloo, one thread per rank. The model is examples/gpt/model.py (4 layers
x 128, 4 heads, vocabulary 128, no dropout, block_size = the longest sequence), fp32, micro-batch
1, the same seeded weights and token batches everywhere; ``"context_parallel": {"size": N,
"method": "ring" | "ulysses"}``, SGD (lr 0.1) through the engine; each rank feeds
``engine.shard_sequence`` of the batch (chunks r and 2N-1-r of 2N).

1. **Activation bytes per rank**: one forward (with grad) per (method, sequence) under
   ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves for backward,
   counted once per storage (by data_ptr, so views are free), parameters excluded. Printed per
   rank (the largest over ranks), its ratio to cp 1 and to the 1/cp ideal (1.00 = exactly 1/cp).
2. **Traffic per rank per forward**: ``shardwise.comm.stats()`` over that same forward, against
   the formulas (L layers, b batch, S sequence, h = n_embd, 4 bytes): Ulysses 4 all-to-alls per
   layer of b*(S/cp)*h elements each (the tensor a rank hands to the all-to-all); ring (cp-1) K
   and (cp-1) V blocks of b*(S/cp)*h elements sent per layer.
3. **Step time**: forward + backward + SGD step via the engine, W warm-up then N timed steps,
   each between two barriers, costing what the slowest rank took (wall and CPU); the median.
   The machine has 2 cores: cp 4 runs 4 processes on them (oversubscribed 2x), so its wall time
   says nothing about 4 devices; the CPU column (all of a rank's threads) is the fairer one.
   Losses are checked against cp 1 (the same global mean loss; reductions differ by ulps).

Torch's peer, ``torch.distributed.tensor.experimental.context_parallel``, is tried once in the
cp 2 world on the same model and batch; on CPU it fails (it replaces SDPA's CUDA kernels, CPU
SDPA dispatches to another op): the run prints the error's first line and compares with the
single process only.

Flags: ``--seqs`` (activation and traffic, 4096,8192), ``--time-seqs`` (step time, 4096,8192),
``--steps`` (3), ``--warmup`` (1), ``--worlds`` (1,2,4), ``--layers`` 4, ``--d-model`` 128,
``--heads`` 4, ``--vocab`` 128. Defaults take about 3.5 minutes on 2 cores (load average 7-12).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # run as a script: find common.py
from common import format_table, single_thread  # noqa: E402
from tp_vs_torch import load_example_gpt  # noqa: E402

from shardwise.monitor.memory import saved_storages  # noqa: E402

LR = 0.1
LOSS_TOLERANCE = 1e-4  # same weights and data; only the order of reductions differs
FP32 = 4


def make_gpt(args: argparse.Namespace) -> torch.nn.Module:
    """The same initial weights in every world: the seed alone decides them."""
    gpt = load_example_gpt()
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(
        vocab_size=args.vocab,
        block_size=max(args.seqs + args.time_seqs),
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.d_model,
        dropout=0.0,
    )
    return gpt.GPT(cfg)


def batch(args: argparse.Namespace, seq: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (1, seq) and their targets for step ``step``: the same in every world."""
    g = torch.Generator().manual_seed(1000 * seq + step)
    tokens = torch.randint(0, args.vocab, (1, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build(args: argparse.Namespace, method: str) -> object:
    import shardwise

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "context_parallel": {"size": args.cp, "method": method},
        "steps_per_print": 10**9,
    }
    engine, *_ = shardwise.initialize(model=make_gpt(args), config=config)
    return engine


# ----------------------------------------------------------------------------- one world


def saved_bytes(engine: object, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd saves in one forward: each storage once (by data_ptr, so views are not
    counted twice), parameters excluded."""

    def forward() -> None:  # the loss, its graph and what it saved are dropped on return
        engine(engine.shard_sequence(x), engine.shard_sequence(y))

    return sum(saved_storages(forward, engine.module.parameters()).values())


def measure_forward(args: argparse.Namespace, engine: object, method: str, seq: int) -> dict:
    from shardwise import comm

    x, y = batch(args, seq, 0)
    comm.barrier()
    comm.reset_stats()
    nbytes = saved_bytes(engine, x, y)
    traffic = {k: v for k, v in comm.stats().items() if k != "barrier"}
    worst = torch.tensor([nbytes], dtype=torch.float64)
    if args.cp > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"method": method, "seq": seq, "bytes": int(worst.item()), "comm": traffic}


def time_steps(args: argparse.Namespace, step: object, seq: int) -> dict:
    """``step(x, y)`` (returns the loss) warmup + steps times; slowest rank per step."""
    from shardwise import comm

    walls, cpus, losses = [], [], []
    for i in range(args.warmup + args.steps):
        x, y = batch(args, seq, i)
        comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step(x, y)
        comm.barrier()
        if i >= args.warmup:
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        losses.append(float(loss.detach()))
    slowest = torch.tensor([walls, cpus], dtype=torch.float64)
    mean = torch.tensor(losses, dtype=torch.float64)
    if args.cp > 1:  # each rank's loss is the mean over its tokens, equal counts: mean of means
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(mean)
        mean /= args.cp
    wall, cpu = statistics.median(slowest[0].tolist()), statistics.median(slowest[1].tolist())
    return {"seq": seq, "wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu, "losses": mean.tolist()}


def engine_step(engine: object) -> object:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(engine.shard_sequence(x), engine.shard_sequence(y))
        engine.backward(loss)
        engine.step()
        return loss

    return step


def torch_peer(args: argparse.Namespace) -> str:
    """One step of torch's context_parallel on this world; "" if it ran, else the error's
    first line (the same answer on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    model = make_gpt(args)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    mesh = init_device_mesh("cpu", (args.cp,), mesh_dim_names=("cp",))
    x, y = batch(args, args.time_seqs[0], 0)
    why = ""
    try:
        with context_parallel(mesh, buffers=[x, y], buffer_seq_dims=[1, 1]):
            model(x, y).backward()  # x, y are sharded in place inside the block
        opt.step()
    except Exception as e:  # the message is what we report
        why = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
    failed = torch.tensor([1 if why else 0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return why or ("failed on another rank" if failed.item() else "")


def run_world(args: argparse.Namespace) -> dict:
    out: dict = {"cp": args.cp, "forward": [], "steps": [], "peer": None}
    out["load_start"] = os.getloadavg()[0]
    for method in ["ring", "ulysses"] if args.cp > 1 else ["none"]:
        engine = build(args, "ring" if method == "none" else method)
        for seq in args.seqs:
            out["forward"].append(measure_forward(args, engine, method, seq))
        for seq in args.time_seqs:
            row = time_steps(args, engine_step(engine), seq)
            out["steps"].append({"method": method, **row})
        engine.destroy()
    if args.cp == 2 and not args.skip_peer:
        out["peer"] = torch_peer(args)
    out["load_end"] = os.getloadavg()[0]
    return out


# ----------------------------------------------------------------------------- the driver


def launch(args: argparse.Namespace, cp: int, path: str, passthrough: list[str]) -> None:
    """World ``cp``: one process for cp 1 (no launcher), else ``shardwise run``."""
    me = [str(Path(__file__).resolve()), "--cp", str(cp), "--out", path, *passthrough]
    if cp == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", str(cp), *me]
    print(f"[load {os.getloadavg()[0]:.1f}] {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"  world {cp} done in {time.perf_counter() - t0:.0f} s", flush=True)


def formula(method: str, cp: int, seq: int, args: argparse.Namespace) -> tuple[str, int]:
    """(op, bytes per rank per forward) the method should move."""
    block = (seq // cp) * args.d_model * FP32  # b*(S/cp)*h elements, b = 1
    if method == "ulysses":
        return "all_to_all", 4 * args.layers * block
    return "send", 2 * (cp - 1) * args.layers * block  # K and V, cp-1 hops each


def activation_table(worlds: list[dict]) -> str:
    base = {r["seq"]: r["bytes"] for w in worlds if w["cp"] == 1 for r in w["forward"]}
    rows = []
    for w in worlds:
        for r in w["forward"]:
            ref = base.get(r["seq"])
            ratio = r["bytes"] / ref if ref else float("nan")
            rows.append(
                [
                    str(w["cp"]),
                    r["method"],
                    str(r["seq"]),
                    f"{r['bytes'] / 2**20:.2f}",
                    f"{ratio:.3f}",
                    f"{ratio * w['cp']:.3f}",
                ]
            )
    headers = ["cp", "method", "seq", "saved MiB/rank", "/ cp 1", "/ (1/cp ideal)"]
    return format_table(headers, sorted(rows, key=lambda r: (int(r[2]), int(r[0]), r[1])))


def comm_table(worlds: list[dict], args: argparse.Namespace) -> str:
    rows = []
    for w in worlds:
        for r in w["forward"]:
            if w["cp"] == 1:
                continue
            op, want = formula(r["method"], w["cp"], r["seq"], args)
            got = r["comm"].get(op, {"calls": 0, "bytes": 0})
            others = sorted(k for k in r["comm"] if k not in (op, "recv"))
            rows.append(
                [
                    str(w["cp"]),
                    r["method"],
                    str(r["seq"]),
                    f"{got['calls']} {op}",
                    f"{got['bytes'] / 2**20:.2f}",
                    f"{want / 2**20:.2f}",
                    f"{got['bytes'] / want:.3f}",
                    ", ".join(others) or "none",
                ]
            )
    headers = ["cp", "method", "seq", "calls/forward", "measured MiB", "formula MiB"]
    return format_table([*headers, "ratio", "other ops"], rows)


def _ratio(a: dict, b: dict | None, key: str) -> str:
    return f"{a[key] / b[key]:.3f}" if b else "-"


def step_table(worlds: list[dict]) -> str:
    base = {r["seq"]: r for w in worlds if w["cp"] == 1 for r in w["steps"]}
    by = {(w["cp"], r["method"], r["seq"]): r for w in worlds for r in w["steps"]}
    rows = []
    for (cp, method, seq), r in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][0])):
        ref = base.get(seq)
        other = by.get((cp, "ulysses", seq)) if method == "ring" else None
        pairs = zip(r["losses"], ref["losses"], strict=True) if ref else []
        loss = max((abs(a - b) for a, b in pairs), default=float("nan"))
        rows.append(
            [str(cp), method, str(seq), f"{r['wall_ms']:.0f}", f"{r['cpu_ms']:.0f}"]
            + [_ratio(r, ref, "wall_ms"), _ratio(r, ref, "cpu_ms")]
            + [_ratio(r, other, "wall_ms"), _ratio(r, other, "cpu_ms"), f"{loss:.1e}"]
        )
    headers = ["cp", "method", "seq", "median ms", "CPU ms", "wall / cp 1", "CPU / cp 1"]
    headers += ["ring / ulysses wall", "ring / ulysses CPU", "max |loss - cp 1|"]
    return format_table(headers, rows)


def report(worlds: list[dict], args: argparse.Namespace) -> None:
    n_params = sum(p.numel() for p in make_gpt(args).parameters())
    print(
        f"\nContext parallelism: examples/gpt GPT {args.layers}x{args.d_model}, {args.heads} "
        f"heads, vocab {args.vocab}, {n_params / 1e6:.2f}M params, fp32, micro-batch 1, gloo, "
        f"1 thread/rank; step = forward + backward + SGD step via the engine, "
        f"{args.warmup} warm-up + {args.steps} timed steps\n"
    )
    print("Activation bytes saved for backward by one forward (largest over ranks):\n")
    print(activation_table(worlds))
    print("\nTraffic per rank per forward (shardwise.comm.stats) against the formula:\n")
    print(comm_table(worlds, args))
    print("\nStep time (slowest rank, median):\n")
    print(step_table(worlds))
    print(f"\n{NOTES}")
    for w in worlds:
        print(f"world {w['cp']}: load average {w['load_start']:.1f} -> {w['load_end']:.1f}")
        if w["peer"] is not None:
            outcome = w["peer"] or "ran (not timed: see README)"
            print(f"  torch context_parallel (cp {w['cp']}): {outcome}")


NOTES = """\
/ cp 1: this rank's bytes over one process's; / (1/cp ideal): that ratio times cp (1.00 = the
bytes fall exactly as 1/cp). measured MiB: the tensors handed to the op (all-to-all input, sent
block), this rank, one forward. cp 4 runs 4 processes on 2 cores: its wall time is
oversubscribed 2x; read the CPU column (all of a rank's threads, gloo's too). ring / ulysses:
the ring's time over Ulysses' at the same cp and sequence. Ulysses saves one (b, S/cp, h) block
per layer more than 1/cp of one process: its local SDPA keeps the output in the head split
(B, H/cp, S, D), the output projection keeps its input in the sequence split; one process and
the ring save one tensor for both (the ring's output is laid out so the heads merge is a view)."""


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    p.add_argument("--seqs", type=ints, default=[4096, 8192], help="activation and traffic")
    p.add_argument("--time-seqs", type=ints, default=[4096, 8192], help="step time")
    p.add_argument("--worlds", type=ints, default=[1, 2, 4], help="context sizes (driver)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--skip-peer", action="store_true", help="do not try torch's peer")
    p.add_argument("--cp", type=int, default=0, help="run one world of this size (launched)")
    p.add_argument("--out", default="", help="where a world writes its figures (JSON)")
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = []  # the flags every world gets: all but --worlds
    while argv:
        flag = argv.pop(0)
        if flag == "--worlds":
            argv.pop(0)
        elif not flag.startswith("--worlds="):
            passthrough.append(flag)
    return args, passthrough


def main(argv: list[str] | None = None) -> None:
    args, passthrough = parse_args(argv)
    single_thread()
    if args.cp:  # one world, launched by the driver (or by hand)
        if args.cp > 1 and not dist.is_initialized():
            dist.init_process_group("gloo")
        result = run_world(args)
        if args.cp == 1 or dist.get_rank() == 0:
            Path(args.out or f"cp{args.cp}.json").write_text(json.dumps(result))
        if args.cp > 1:
            dist.barrier()
            dist.destroy_process_group()
        return
    worlds = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.worlds:
            path = str(Path(tmp) / f"cp{cp}.json")
            launch(args, cp, path, passthrough)
            worlds.append(json.loads(Path(path).read_text()))
    report(worlds, args)


if __name__ == "__main__":
    main()
