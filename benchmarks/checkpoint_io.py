"""Checkpoint save and load: shardwise's storage vs torch.distributed.checkpoint (DCP).

    python -m shardwise run --nproc-per-node 2 benchmarks/checkpoint_io.py

One launch, one gloo world, one thread per rank. For each layout (DP2: every rank holds the
whole model and AdamW state; ZeRO-3 x 2: each rank holds half of the flat parameters and of
their Adam moments), a GPT of ~58M parameters (common.py, d_model 768, 8 layers) is built with
``shardwise.initialize`` and trained one step so the Adam state exists. Then, in interleaved
rounds (ours save, DCP save, ours load, DCP load, ...):

- ours: ``storage.save_pieces`` of the pieces the layout holds (replicated DP tensors saved
  once, spread over the ranks by size), then a ``CheckpointReader`` reading, on every rank,
  every piece it holds into the live tensors (``verify=True``: every CRC-32 checked);
- DCP: ``dcp.save`` / ``dcp.load`` (FileSystemWriter / Reader, its defaults: files fsynced,
  replicated keys deduplicated and spread over ranks) of the same tensors, in place. Under
  ZeRO-3 DCP gets each rank's flat unit shards whole (fewer, larger tensors than our
  per-parameter pieces: the easier job).

A save or load is timed between two barriers (the slowest rank's time); figures are medians
over the rounds. Loads read files the save just wrote, from the page cache, for both. After
every load the state must equal what was saved, bit for bit.
"""

from __future__ import annotations

import argparse
import math
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
from common import format_table, make_batches, make_model, n_params, single_thread  # noqa: E402

import shardwise  # noqa: E402
from shardwise.checkpoint.pieces import Piece  # noqa: E402
from shardwise.checkpoint.storage import CheckpointReader, save_pieces  # noqa: E402

LAYOUTS = {"dp2": 0, "zero3": 3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layouts", default="dp2,zero3", help="comma-separated: dp2, zero3")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    return p.parse_args(argv)


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


def balance(pieces: list[Piece], world: int, rank: int) -> None:
    """Replicated pieces: each saved by one rank, the ranks' byte totals kept even (the same
    greedy choice on every rank, so no communication)."""
    load = [0] * world
    for p in pieces:
        owner = min(range(world), key=load.__getitem__)
        load[owner] += p.tensor.numel() * p.tensor.element_size()
        p.save = owner == rank


def dp_state(engine: shardwise.Engine) -> tuple[list[Piece], dict[str, torch.Tensor]]:
    """Every parameter and its AdamW state, whole and replicated."""
    pieces = []
    for name, p in engine.module.named_parameters():
        whole = tuple((0, n) for n in p.shape)
        pieces.append(Piece(f"model/{name}", tuple(p.shape), whole, None, p.data))
        for key, v in engine.optimizer.state[p].items():
            pieces.append(
                Piece(
                    f"optim/{key}/{name}", tuple(v.shape), tuple((0, n) for n in v.shape), None, v
                )
            )
    balance(pieces, dist.get_world_size(), dist.get_rank())
    return pieces, {p.name: p.tensor for p in pieces}


def zero3_state(engine: shardwise.Engine) -> tuple[list[Piece], dict[str, torch.Tensor]]:
    """Per parameter, the flat range of it that this rank's unit shard holds, for the weights
    and each Adam moment (fp32: the master is the shard); DCP gets the unit shards whole."""
    rank, names = dist.get_rank(), {id(p): n for n, p in engine.module.named_parameters()}
    pieces, flat = [], {}
    for j, u in enumerate(engine.strategy.units):
        lay, s = u.layout, u.layout.shard_numel
        state = engine.strategy.optimizer.state[u.master]
        tensors = {"model": u.shard} | {f"optim/{k}": v for k, v in state.items() if v.dim()}
        flat |= {f"unit{j}/{k}/rank{rank}": v for k, v in tensors.items()}
        for i, p in enumerate(lay.params):
            numel = math.prod(lay.shapes[i])
            lo, hi = max(lay.offsets[i], rank * s), min(lay.offsets[i] + numel, (rank + 1) * s)
            if lo >= hi:
                continue
            shape = tuple(lay.shapes[i])
            whole, part = tuple((0, n) for n in shape), (lo - lay.offsets[i], hi - lay.offsets[i])
            for k, v in tensors.items():
                local = v[lo - rank * s : hi - rank * s]  # of this rank's shard
                pieces.append(Piece(f"{k}/{names[id(p)]}", shape, whole, part, local))
    return pieces, flat


# ----------------------------------------------------------------------------- the contenders


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def ours_load(path: str, pieces: list[Piece], verify: bool = True) -> None:
    with CheckpointReader(path, verify=verify) as r:
        for p in pieces:
            box = tuple((a, min(b, n)) for (a, b), n in zip(p.box, p.global_shape, strict=True))
            (saved,) = [s for s in r.pieces(p.name) if s.box == box and s.flat == p.flat]
            r.read(saved, out=p.tensor)


def dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def one_round(r: int, layout: str, state: tuple, root: str, times: dict) -> tuple[str, str]:
    """Save and load once with each contender; return the two checkpoint paths."""
    pieces, flat, reference = state
    ours_dir, tag = os.path.join(root, layout, "ours"), f"round{r}"
    ours_path, dcp_path = os.path.join(ours_dir, tag), os.path.join(root, layout, "dcp", tag)
    contenders = [
        ("ours save", partial(save_pieces, ours_dir, tag, pieces, {}, {"layout": layout})),
        ("dcp save", partial(dcp.save, flat, checkpoint_id=dcp_path)),
        ("ours load", partial(ours_load, ours_path, pieces)),
        ("ours load nv", partial(ours_load, ours_path, pieces, verify=False)),
        ("dcp load", partial(dcp.load, flat, checkpoint_id=dcp_path)),
    ]
    for name, fn in contenders:
        if "load" in name:
            for v in flat.values():
                v.zero_()
        times.setdefault(name, []).append(timed(fn))
        bad = [k for k, v in flat.items() if not torch.equal(v, reference[k])]
        assert not bad, f"{layout} {name}: {len(bad)} tensors differ after it, e.g. {bad[0]}"
    return ours_path, dcp_path


def run_layout(args: argparse.Namespace, layout: str, root: str) -> dict[str, float]:
    engine = build_engine(args, LAYOUTS[layout])
    pieces, flat = (dp_state if layout == "dp2" else zero3_state)(engine)
    state = (pieces, flat, {k: v.clone() for k, v in flat.items()})
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        paths = one_round(r, layout, state, root, times)
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
            f"{m['ours load']:.2f}", f"{m['ours load nv']:.2f}", f"{m['dcp load']:.2f}",
            f"{m['ours load'] / m['dcp load']:.2f}",
            f"{m['ours bytes'] / 2**20:.0f}", f"{m['dcp bytes'] / 2**20:.0f}",
        ])  # fmt: skip
    headers = ["layout", "params", "save s ours", "save s DCP", "ours/DCP", "load s ours",
               "(no verify)", "load s DCP", "ours/DCP", "MiB ours", "MiB DCP"]  # fmt: skip
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    single_thread()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    # The same directory on every rank (a shared filesystem, as for any sharded checkpoint).
    port = os.environ.get("MASTER_PORT", "0")
    root = args.dir or os.path.join(tempfile.gettempdir(), f"shardwise-ckpt-bench-{port}")
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
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
