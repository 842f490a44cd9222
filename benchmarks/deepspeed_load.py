"""Loading a DeepSpeed ZeRO-3 checkpoint: shardwise's load_checkpoint vs DeepSpeed's own.

    python -m shardwise run --nproc-per-node 2 benchmarks/deepspeed_load.py

One gloo world, one thread per rank. DeepSpeed 0.19 (ZeRO-3, fp32, torch AdamW as a client
optimizer) trains the GPT of common.py one step and saves. Then, in interleaved rounds, a
fresh engine of each side loads those same files, timed between two barriers (the slowest
rank's time; engines are built before the clock starts):

- DeepSpeed: ``engine.load_checkpoint(dir)`` (``torch.load(weights_only=False)`` of this rank's
  model and optimizer files, its partitions copied in);
- shardwise: ``engine.load_checkpoint(dir)`` of a ZeRO-3 engine on the same ranks: the files
  read with ``weights_only=True`` and memory-mapped, each rank reading every rank's optimizer
  file header but only the bytes of its own parameters' pieces, the whole load checked before
  anything is assigned.

Files come from the page cache after the first round, for both. After every shardwise load its
fp32 masters must equal DeepSpeed's (its safe_get_full_fp32_param), bit for bit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find common.py
from common import import_deepspeed, make_batches, make_model, n_params, single_thread  # noqa: E402

import shardwise  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    return p.parse_args(argv)


def config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def deepspeed_engine(ds: object, args: argparse.Namespace) -> object:
    model = make_model(args, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = ds.initialize(model=model, optimizer=opt, config=config())
    return engine


def shardwise_engine(args: argparse.Namespace) -> shardwise.Engine:
    model = make_model(args, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = shardwise.initialize(model=model, optimizer=opt, config=config())
    return engine


def save_deepspeed(ds: object, args: argparse.Namespace, root: str) -> dict[str, torch.Tensor]:
    """One DeepSpeed step, saved; its fp32 masters (whole) for the check."""
    from deepspeed.utils import safe_get_full_fp32_param

    engine = deepspeed_engine(ds, args)
    x, y = make_batches(1, 2, args.seq)[0]
    rank = dist.get_rank()
    loss = engine(x[rank : rank + 1], y[rank : rank + 1])
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(root, tag="ds")
    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def check(engine: shardwise.Engine, masters: dict[str, torch.Tensor]) -> None:
    got = engine.consolidated_state_dict()  # fp32 training: the weights are the masters
    bad = [n for n, want in masters.items() if not torch.equal(got[n], want)]
    assert not bad, f"shardwise loaded {bad[:3]} differently from DeepSpeed's masters"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    single_thread()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    ds, why = import_deepspeed()
    if ds is None:
        raise SystemExit(f"DeepSpeed is needed: {why}")
    port = os.environ.get("MASTER_PORT", "0")
    root = args.dir or os.path.join(tempfile.gettempdir(), f"shardwise-dsload-bench-{port}")
    masters = save_deepspeed(ds, args, root)
    times: dict[str, list[float]] = {"DeepSpeed": [], "shardwise": []}
    for _ in range(args.rounds):
        theirs = deepspeed_engine(ds, args)
        times["DeepSpeed"].append(timed(lambda e=theirs: e.load_checkpoint(root, tag="ds")))
        del theirs
        ours = shardwise_engine(args)
        times["shardwise"].append(timed(lambda e=ours: e.load_checkpoint(root, tag="ds")))
        check(ours, masters)
        del ours
    if dist.get_rank() == 0:
        size = sum(f.stat().st_size for f in Path(root, "ds").iterdir()) / 2**20
        print(f"{n_params(make_model(args)) / 1e6:.1f}M parameters, ZeRO-3 x "
              f"{dist.get_world_size()} ranks, {size:.0f} MiB of files, {args.rounds} rounds")  # fmt: skip
        for who, ts in times.items():
            print(f"{who:10s} load_checkpoint: median {statistics.median(ts):.2f} s "
                  f"({', '.join(f'{t:.2f}' for t in ts)})")  # fmt: skip
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
