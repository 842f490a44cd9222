"""ZeRO stages 1-3, side by side: shardwise vs DeepSpeed's same stage vs torch's nearest peer.

    DS_ACCELERATOR=cpu python -m shardwise run --nproc-per-node 2 benchmarks/zero.py

One launch, one gloo world, one thread per rank. For each dtype (fp32, then bf16), every
contender is built in the same processes from the same seeded weights and trained on the same
batches with the same torch AdamW: our stages 1, 2, 3; torch DDP (the peer of stages 1-2: it
shards nothing) and FSDP2 (stage 3's peer); DeepSpeed stages 1, 2, 3. Rounds interleave them
(ours Z1, ours Z2, ..., DeepSpeed Z3, ours Z1, ...) so that a machine slowing down mid-run
slows all of them alike. A step is forward + backward + optimizer step + zeroing, timed
between two barriers; it costs what the SLOWEST rank took, and a contender's figure is the
median of its timed steps.

After the timed rounds, one more step per contender measures its model-state bytes from live
tensors, after backward and after the update (gradients of some engines live only between the
two), against the ZeRO formula. Then the losses must agree: a benchmark of an engine that
trains something else is worth nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common.py
from common import (  # noqa: E402
    add_model_args,
    format_table,
    import_deepspeed,
    make_batches,
    make_model,
    median_ms,
    n_params,
    single_thread,
    timed_steps,
)
from zero_peers import (  # noqa: E402
    KINDS,
    LR,
    Contender,
    build_ddp,
    build_deepspeed,
    build_fsdp2,
    build_ours,
    formula_bytes,
)

# Same weights and data: engines may only add in another order, a few ulps in fp32; in bf16
# (8 mantissa bits) the same reordering can move a loss by ~1e-3 per step. A contender beyond
# these trains something else. (In the recorded runs every loss matched to the last bit.)
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(rounds=3, steps=3)  # 2 dtypes x 8 contenders: keeps the run near 5 minutes
    p.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument(
        "--bucket-elements",
        type=int,
        default=2**22,
        help="reduce_bucket_size and allgather_bucket_size, ours and DeepSpeed's (shardwise's "
        "default; DeepSpeed's 5e8 would make one bucket, and a 2 GB ZeRO-3 buffer)",
    )
    p.add_argument(
        "--prefetch-elements",
        type=int,
        default=50_000_000,
        help="stage3_prefetch_bucket_size, both (the default of both)",
    )
    p.add_argument(
        "--persistence-threshold",
        type=int,
        default=0,
        help="stage3_param_persistence_threshold, both: 0 shards every parameter, so memory "
        "meets the formula exactly (DeepSpeed's default is 1e5)",
    )
    p.add_argument("--skip-deepspeed", action="store_true", help="no DeepSpeed contenders")
    p.add_argument("--skip-torch", action="store_true", help="no DDP / FSDP2 contenders")
    args = p.parse_args(argv)
    args.stages = sorted({int(s) for s in args.stages.split(",")})
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    if not set(args.stages) <= {1, 2, 3} or not set(args.dtypes) <= {"fp32", "bf16"}:
        p.error("--stages takes 1, 2, 3; --dtypes takes fp32, bf16")
    return args


def build_all(args: argparse.Namespace, dtype: str, ds: object | None) -> list[Contender]:
    out = [build_ours(args, s, dtype) for s in args.stages]
    if not args.skip_torch:
        if {1, 2} & set(args.stages):
            out.append(build_ddp(args, dtype))
        if 3 in args.stages:
            out.append(build_fsdp2(args, dtype))
    if ds is not None:
        out += [build_deepspeed(args, ds, s, dtype) for s in args.stages]
    return out


def local_rows(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    return x[rows], y[rows]


def run_block(c: Contender, batches: list, warmup: int, steps: int) -> None:
    """``warmup`` untimed then ``steps`` timed steps of ``c``, continuing its batch sequence."""

    def step(i: int) -> torch.Tensor:
        loss = c.backward(*local_rows(*batches[i]))
        c.update()
        return loss

    timed_steps(c, step, warmup, steps)


def probe_memory(c: Contender, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One more (untimed, unrecorded) step: bytes by kind after backward and after the update,
    the larger of the two per kind, the largest over ranks."""
    gc.collect()  # tensors of the previous step still waiting for the collector are not state
    c.backward(*local_rows(*batch))
    gc.collect()
    after_backward = c.probe()
    c.update()
    gc.collect()
    after_update = c.probe()
    worst = torch.tensor(
        [max(after_backward[k], after_update[k]) for k in KINDS], dtype=torch.float64
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    c.memory = dict(zip(KINDS, (int(v) for v in worst.tolist()), strict=True))


def run_dtype(args: argparse.Namespace, dtype: str, ds: object | None) -> list[Contender]:
    contenders = build_all(args, dtype, ds)
    per_block = args.warmup + args.steps
    batches = make_batches(
        args.rounds * per_block + 1, args.micro_batch * dist.get_world_size(), args.seq
    )
    for r in range(args.rounds):
        for c in contenders:
            run_block(c, batches, args.warmup, args.steps)
        if dist.get_rank() == 0:
            done = ", ".join(
                f"{c.name} {median_ms(c.times[-args.steps :]):.0f}" for c in contenders
            )
            print(f"{dtype} round {r + 1}/{args.rounds} (ms): {done}", flush=True)
    for c in contenders:
        probe_memory(c, batches[-1])
    return contenders


# ----------------------------------------------------------------------------- report


def peer_of(c: Contender, contenders: list[Contender]) -> Contender:
    """The run ``c`` is checked against: ours of the same stage (ours Zs: our lowest stage;
    DDP, which shards nothing: our lowest stage too)."""
    ours = [o for o in contenders if o.name.startswith("shardwise")]
    same = [o for o in ours if o.stage == c.stage and o is not c]
    return same[0] if same and not c.name.startswith("shardwise") else ours[0]


def memory_cells(c: Contender, psi: int, dtype: str) -> list[str]:
    mib = [c.memory[k] / 2**20 for k in KINDS]
    state = sum(mib[:3])
    formula = formula_bytes(c.stage, dtype, psi, dist.get_world_size()) / 2**20
    return [*(f"{v:.1f}" for v in mib), f"{state:.1f}", f"{formula:.1f}", f"{state / formula:.3f}"]


def contender_table(contenders: list[Contender], psi: int, dtype: str) -> tuple[str, float]:
    headers = ["contender", "median ms", "min ms", "CPU ms", "params", "grads", "optim"]
    headers += ["comm", "state MiB", "formula", "state/formula", "final loss", "max |dloss|", "vs"]
    rows, worst = [], 0.0
    for c in contenders:
        ref = peer_of(c, contenders)
        diff = max(abs(a - b) for a, b in zip(c.losses, ref.losses, strict=True))
        worst = max(worst, diff)
        rows.append(
            [c.name, f"{median_ms(c.times):.1f}", f"{1e3 * min(c.times):.1f}"]
            + [f"{median_ms(c.cpu):.1f}", *memory_cells(c, psi, dtype)]
            + [f"{c.losses[-1]:.4f}", f"{diff:.1e}", "-" if ref is c else ref.name]
        )
    return format_table(headers, rows), worst


def ratio_rows(contenders: list[Contender], dtype: str) -> list[list[str]]:
    """ours Zs / DeepSpeed Zs and ours Zs / torch's peer, wall and CPU: <= 1 is a win."""
    by_name = {c.name: c for c in contenders}
    rows = []
    for ours in (c for c in contenders if c.name.startswith("shardwise")):
        torch_peer = "torch FSDP2" if ours.stage == 3 else "torch DDP"
        for peer in (by_name.get(f"DeepSpeed Z{ours.stage}"), by_name.get(torch_peer)):
            if peer is None:
                continue
            wall = median_ms(ours.times) / median_ms(peer.times)
            cpu = median_ms(ours.cpu) / median_ms(peer.cpu)
            rows.append(
                [f"Z{ours.stage} {dtype}", peer.name, f"{median_ms(ours.times):.1f}"]
                + [f"{median_ms(peer.times):.1f}", f"{wall:.3f}", f"{median_ms(ours.cpu):.1f}"]
                + [f"{median_ms(peer.cpu):.1f}", f"{cpu:.3f}"]
            )
    return rows


LEGEND = """\
ms: wall time of the slowest rank; CPU ms: CPU time of all its threads (gloo's too), nearly
blind to other load on the machine: the column to read for differences under ~10%.
params / grads / optim / comm: MiB this rank holds (the most over ranks), each storage once, the
larger of after-backward and after-update per kind (grads of DDP, FSDP2 and DeepSpeed live only
between the two); ours from engine.memory_breakdown(), peers walked from their live tensors
(optim includes fp32 master copies). state = params + grads + optim, against the ZeRO formula
of the stage each implements (DDP: plain data parallelism; fp32 Adam (4, 4, 8) bytes/param,
bf16 + fp32 master (2, 2, 12)). comm: buffers kept alive beside the states (DDP's buckets;
DeepSpeed ZeRO-3's reduce bucket), not in the formula. max |dloss|: largest difference of any
step's loss (mean over ranks) from the run named in "vs"."""


def report(args: argparse.Namespace, results: dict[str, list[Contender]], notes: list[str]) -> None:
    psi = n_params(make_model(args))
    print(
        f"\nZeRO benchmark: GPT {args.layers}x{args.d_model}, seq {args.seq}, {psi / 1e6:.2f}M "
        f"params; {dist.get_world_size()} ranks x micro-batch {args.micro_batch}, gloo, 1 "
        f"thread/rank; {args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed) "
        f"steps; AdamW lr {LR}; buckets {args.bucket_elements} elements, stage-3 persistence "
        f"threshold {args.persistence_threshold}, prefetch {args.prefetch_elements}"
    )
    ratios = []
    for dtype, contenders in results.items():
        table, worst = contender_table(contenders, psi, dtype)
        print(f"\n{dtype}:\n\n{table}\n")
        verdict = "agree" if worst <= LOSS_TOLERANCE[dtype] else "DIFFER: timings not comparable"
        print(f"{dtype} losses {verdict} (max {worst:.1e}, tolerance {LOSS_TOLERANCE[dtype]:g})")
        ratios += ratio_rows(contenders, dtype)
    if ratios:
        headers = ["ours", "peer", "ours ms", "peer ms", "ours/peer", "ours CPU"]
        headers += ["peer CPU", "CPU ours/peer"]
        print(f"\nratios (<= 1.000: ours is as fast or faster):\n\n{format_table(headers, ratios)}")
    print(f"\n{LEGEND}")
    for line in notes:
        print(line)
    print(f"load average (1 min): {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def buffer_notes(results: dict[str, list[Contender]]) -> list[str]:
    """The buffers found beside the peers' known states (rank 0), so the report says what
    they are and what they were counted as."""
    out = []
    for dtype, contenders in results.items():
        for c in contenders:
            for path, nbytes in c.found:
                if nbytes >= 2**10:  # flags and scalars (an inf/nan tracker) are not memory
                    out.append(f"{c.name} {dtype}: {path} {nbytes / 2**20:.1f} MiB")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The peers call collectives torch 2.13 deprecates (all_gather_into_tensor, ...): one
    # warning per call site and rank, about their code, drowning the round lines.
    warnings.filterwarnings("ignore", r".*torch\.distributed\..* is deprecated", FutureWarning)
    single_thread()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    notes = []
    ds = None
    if args.skip_deepspeed:
        notes.append("DeepSpeed skipped: --skip-deepspeed")
    else:
        ds, why = import_deepspeed()
        if ds is None:
            notes.append(f"DeepSpeed skipped: cannot import it ({why}); pip install -e '.[bench]'")
    t0 = time.perf_counter()
    results = {}
    for dtype in args.dtypes:
        results[dtype] = run_dtype(args, dtype, ds)
        gc.collect()
    if dist.get_rank() == 0:
        report(args, results, [*buffer_notes(results), *notes])
        print(f"total time {time.perf_counter() - t0:.0f} s")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
