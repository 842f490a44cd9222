"""Checkpoint save and load: shardwise's storage vs torch.distributed.checkpoint (DCP).

    python -m shardwise run --nproc-per-node 2 benchmarks/checkpoint_io.py

One launch, one gloo world, one thread per rank. For each layout (DP2: every rank holds the
whole model and AdamW state; ZeRO-3 x 2: each rank holds half of the flat parameters and of
their Adam moments), a GPT of ~58M parameters (common.py, d_model 768, 8 layers) is built with
``shardwise.initialize`` and trained one step so the Adam state exists. Then, in interleaved
rounds (ours save, DCP save, ours load, DCP load, ...):

- ours: the engine's ``save_checkpoint`` / ``load_checkpoint`` (everything a resume needs:
  the pieces of the layout, every rank's random state, counters; a load checks every CRC-32
  of what it reads and restores the optimizer states and random streams);
- DCP: ``dcp.save`` / ``dcp.load`` (FileSystemWriter / Reader, its defaults: files fsynced,
  replicated keys deduplicated and spread over ranks) of the weights and Adam moments, in
  place. Under ZeRO-3 DCP gets each rank's flat unit shards whole (fewer, larger tensors than
  our per-parameter pieces: the easier job).

A save or load is timed between two barriers (the slowest rank's time); figures are medians
over the rounds. Loads read files the save just wrote, from the page cache, for both. After
every load the state must equal what was saved, bit for bit.

Asynchronous saves (checkpoint_async.py, in the same rounds): ``save_checkpoint(...,
async_save=True)`` against ``dcp.async_save`` on the same engine: the time a save blocks
training, the step-time overhead of a save every ``--every`` steps, and the resident memory
of a small model over ``--rss-saves`` saves (after ``--rss-warmup``), measured first, while
the processes hold nothing else. ``--small`` shrinks the
model (d_model 256, 2 layers) for a run of a few minutes; ``--skip-async`` leaves them out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common.py
import checkpoint_async  # noqa: E402
from common import format_table, make_batches, make_model, n_params, single_thread  # noqa: E402

import shardwise  # noqa: E402

LAYOUTS = {"dp2": 0, "zero3": 3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layouts", default="dp2,zero3", help="comma-separated: dp2, zero3")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--small", action="store_true", help="d_model 256, 2 layers: a quick run")
    p.add_argument("--skip-async", action="store_true", help="only the blocking rows")
    p.add_argument("--every", type=int, default=5, help="async rows: a save every k steps")
    p.add_argument("--blocking-samples", type=int, default=2, help="async saves timed a round")
    p.add_argument("--intervals", type=int, default=2, help="async rows: saves per timed block")
    p.add_argument("--rss-saves", type=int, default=100, help="saves whose RSS drift is measured")
    p.add_argument("--rss-warmup", type=int, default=10, help="saves before the RSS baseline")
    p.add_argument("--rss-d-model", type=int, default=128, help="the RSS run's small model")
    args = p.parse_args(argv)
    if args.small:
        args.d_model, args.layers = 256, 2
    return args


# ----------------------------------------------------------------------------- the states


def build_engine(args: argparse.Namespace, stage: int) -> shardwise.Engine:
    model = make_model(args)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
    }
    engine, *_ = shardwise.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    x, y = make_batches(1, 2, args.seq)[0]
    rank = dist.get_rank()
    loss = engine(x[rank : rank + 1], y[rank : rank + 1])
    engine.backward(loss)
    engine.step()  # the Adam moments exist now
    return engine


def dp_state(engine: shardwise.Engine) -> dict[str, torch.Tensor]:
    """Every parameter and its AdamW state, whole and replicated (DCP deduplicates them)."""
    flat = {}
    for name, p in engine.module.named_parameters():
        flat[f"model/{name}"] = p.data
        flat |= {f"optim/{k}/{name}": v for k, v in engine.optimizer.state[p].items()}
    return flat


def zero3_state(engine: shardwise.Engine) -> dict[str, torch.Tensor]:
    """This rank's unit shards of the weights and of each Adam moment (fp32: the master is the
    shard), whole, under rank-specific keys."""
    rank, flat = dist.get_rank(), {}
    for j, u in enumerate(engine.strategy.units):
        state = engine.strategy.optimizer.state[u.master]
        tensors = {"model": u.shard} | {f"optim/{k}": v for k, v in state.items() if v.dim()}
        flat |= {f"unit{j}/{k}/rank{rank}": v for k, v in tensors.items()}
    return flat


# ----------------------------------------------------------------------------- the contenders


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def load_unverified(engine: shardwise.Engine, load_dir: str, tag: str) -> None:
    """The engine's load with ``"checkpoint": {"verify": false}``: no CRC pass, as DCP."""
    saved = engine.config
    no_crc = dataclasses.replace(saved.checkpoint, verify=False)
    engine.config = dataclasses.replace(saved, checkpoint=no_crc)
    try:
        engine.load_checkpoint(load_dir, tag)
    finally:
        engine.config = saved


def one_round(r: int, layout: str, engine: shardwise.Engine, root: str, times: dict) -> tuple:
    """Save and load once with each contender; return the two checkpoint paths. Before each
    load the live state is zeroed; after every call it must equal the reference bit for bit
    (collected anew: a load may replace the optimizer's state tensors)."""
    collect = dp_state if layout == "dp2" else zero3_state
    reference = {k: v.clone() for k, v in collect(engine).items()}
    ours_dir, tag = os.path.join(root, layout, "ours"), f"round{r}"
    ours_path, dcp_path = os.path.join(ours_dir, tag), os.path.join(root, layout, "dcp", tag)
    contenders = [
        ("ours save", partial(engine.save_checkpoint, ours_dir, tag)),
        ("dcp save", lambda: dcp.save(collect(engine), checkpoint_id=dcp_path)),
        ("ours load", partial(engine.load_checkpoint, ours_dir, tag)),
        ("ours load unverified", partial(load_unverified, engine, ours_dir, tag)),
        ("dcp load", lambda: dcp.load(collect(engine), checkpoint_id=dcp_path)),
    ]
    for name, fn in contenders:
        if "load" in name:
            for v in collect(engine).values():
                v.zero_()
        times.setdefault(name, []).append(timed(fn))
        got = collect(engine)
        bad = [k for k, v in reference.items() if not torch.equal(got[k], v)]
        assert not bad, f"{layout} {name}: {len(bad)} tensors differ after it, e.g. {bad[0]}"
    return ours_path, dcp_path


def run_layout(args: argparse.Namespace, layout: str, root: str) -> dict[str, float]:
    engine = build_engine(args, LAYOUTS[layout])
    collect = dp_state if layout == "dp2" else zero3_state
    trainer = checkpoint_async.Trainer(engine, args.seq, collect, root)
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        paths = one_round(r, layout, engine, root, times)
        if not args.skip_async:
            checkpoint_async.one_round(r, trainer, args, os.path.join(root, layout), times)
        sizes = {"ours bytes": dir_bytes(paths[0]), "dcp bytes": dir_bytes(paths[1])}
        dist.barrier()
        if dist.get_rank() == 0 and r + 1 < args.rounds:  # untimed: the next round writes anew
            for path in paths:
                shutil.rmtree(path)
    units = getattr(engine.strategy, "units", None)
    params = sum(u.layout.numel for u in units) if units else n_params(engine.module)
    return {k: statistics.median(v) for k, v in times.items()} | sizes | {"params": params}


def report(results: dict[str, dict[str, float]]) -> str:
    rows = []
    for layout, m in results.items():
        rows.append([
            layout, f"{m['params'] / 1e6:.1f}M",
            f"{m['ours save']:.2f}", f"{m['dcp save']:.2f}", f"{m['ours save'] / m['dcp save']:.2f}",
            f"{m['ours load']:.2f}", f"{m['dcp load']:.2f}",
            f"{m['ours load'] / m['dcp load']:.2f}",
            f"{m['ours load unverified']:.2f}",
            f"{m['ours load unverified'] / m['dcp load']:.2f}",
            f"{m['ours bytes'] / 2**20:.0f}", f"{m['dcp bytes'] / 2**20:.0f}",
        ])  # fmt: skip
    headers = ["layout", "params", "save s ours", "save s DCP", "ours/DCP", "load s ours",
               "load s DCP", "ours/DCP", "load s ours, verify off", "ours/DCP",
               "MiB ours", "MiB DCP"]  # fmt: skip
    return format_table(headers, rows)


def rss_marks(args: argparse.Namespace, root: str) -> dict[str, dict[str, float]]:
    """The resident-memory run: a small DP2 engine, each contender's saves in turn."""
    small = argparse.Namespace(**{**vars(args), "d_model": args.rss_d_model, "layers": 2})
    engine = build_engine(small, 0)
    marks = checkpoint_async.memory(args, engine, dp_state, os.path.join(root, "rss"))
    if dist.get_rank() == 0:
        print(f"rss: {marks}", flush=True)
    return marks


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    single_thread()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    # The same directory on every rank (a shared filesystem, as for any sharded checkpoint).
    port = os.environ.get("MASTER_PORT", "0")
    root = args.dir or os.path.join(tempfile.gettempdir(), f"shardwise-ckpt-bench-{port}")
    marks = None if args.skip_async else rss_marks(args, root)  # first: a process still small
    results = {}
    for layout in args.layouts.split(","):
        results[layout] = run_layout(args, layout, root)
        if dist.get_rank() == 0:
            print(f"{layout}: {results[layout]}", flush=True)
    if dist.get_rank() == 0:
        print(
            f"\n{dist.get_world_size()} ranks, gloo, {args.rounds} rounds, medians; files in {root}"
        )
        print(report(results))
        if marks is not None:
            print(f"\nasynchronous saves, a save every {args.every} steps:")
            print(checkpoint_async.report(results, args.every, args.intervals))
            print(f"\nresident memory, d_model {args.rss_d_model}, 2 layers, DP2, MiB:")
            print(checkpoint_async.rss_report(marks, args.rss_warmup))
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
