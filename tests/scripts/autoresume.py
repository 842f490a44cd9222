"""A training script with no checkpoint code of its own, for the preemption tests
(tests/test_preemption.py): the config's ``checkpoint`` block saves and resumes.

    shardwise run --nproc-per-node 2 [--max-restarts N] autoresume.py OUT PHASE [PHASE ...]

Each PHASE is ``LAYOUT[:SIGNAL:RANK:STEP]``, LAYOUT one of LAYOUTS. A phase trains
``--steps`` steps of a small model with dropout (the ``checkpointing`` test models) with
``{"save_dir": OUT/LAYOUT/ckpts, "save_interval_steps": --interval, "auto_resume": true}``,
and rank 0 writes the final weights to OUT/LAYOUT/final.safetensors; then a fresh engine
without the checkpoint block trains the same steps uninterrupted: OUT/LAYOUT/reference.safetensors.
A phase whose final weights exist is skipped (a restarted worker group resumes the phase it
was in). With SIGNAL:RANK:STEP (SIGNAL ``kill`` or ``term``), that rank sends SIGKILL or
SIGTERM to itself in the forward of step STEP (1-based), once (OUT/LAYOUT/signalled marks it).

A phase started before (by an earlier launch or worker group: OUT/LAYOUT/started-rank<N>) draws its
initial weights and random streams from another seed than the reference's: a run that resumed
anything short of everything would not match it.

``--sleep S`` sleeps S seconds after each step and rank 0 records the steps done in
OUT/LAYOUT/progress, so a test can signal the job in the middle of its run. ``--linger S``
sleeps S seconds after the loop with the engine alive (each rank first touches
OUT/LAYOUT/looped-rankR).

``--async`` makes the interval saves asynchronous (``"checkpoint": {"async": true}``);
``--slow-write S`` makes the background writer wait before each file it writes until the
phase's signal was sent (OUT/LAYOUT/signalled exists), at most S seconds: a slow disk whose
save is surely still in flight when the signal comes (the marker records whether one was:
``{"in_flight": true}``).
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared models

from checkpointing import config, engine_for  # noqa: E402

from shardwise.checkpoint import storage  # noqa: E402

Z3 = {"stage": 3, "stage3_param_persistence_threshold": 40}  # biases whole, weights sharded
LAYOUTS = {  # name: (config keys, checkpointing model) on 2 processes
    "dp2": ({}, "mlp"),
    "zero3-dp2": ({"zero_optimization": Z3}, "mlp"),
    "pp2": ({"pipeline": {"stages": 2}}, "pipe"),
}
DROPOUT = 0.1


SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}


def signal_hook(engine, name: str, rank: int, step: int, marker: Path):
    """Send signal ``name`` to this process in a forward of step ``step`` (1-based) on rank
    ``rank``, once."""

    def hook(module, args):
        if engine.global_rank == rank and engine.global_steps == step - 1 and not marker.exists():
            writer = engine.autosave.writer
            in_flight = writer is not None and not writer.handle.done()
            marker.write_text(json.dumps({"in_flight": in_flight, "step": step}))
            os.kill(os.getpid(), SIGNALS[name])

    for module in engine.module.modules():
        module.register_forward_pre_hook(hook)


def save_weights(engine, path: Path) -> None:
    weights = {k: v.float().contiguous() for k, v in engine.consolidated_state_dict().items()}
    if engine.global_rank == 0:
        save_file(weights, str(path))


def phase(out: Path, spec: str, args: argparse.Namespace) -> None:
    layout, *when = spec.split(":")
    extra, model = LAYOUTS[layout]
    folder = out / layout
    if (folder / "final.safetensors").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    block = {"save_dir": str(folder / "ckpts"), "save_interval_steps": args.interval}
    block["async"] = args.async_save
    cfg = config(**extra, checkpoint={**block, "auto_resume": True})
    started = folder / f"started-rank{os.environ['RANK']}"
    again = started.exists()
    started.touch()
    engine = engine_for(cfg, DROPOUT, seed=99 if again else 0, model=model)
    if when:
        signal_hook(engine, when[0], int(when[1]), int(when[2]), folder / "signalled")
    for _ in range(engine.global_steps, args.steps):
        engine.train_batch()
        if args.sleep:
            if engine.global_rank == 0:
                (folder / "progress.tmp").write_text(str(engine.global_steps))
                os.replace(folder / "progress.tmp", folder / "progress")
            time.sleep(args.sleep)
    if args.linger:  # the loop is over, the engine still alive: a SIGTERM now is outside a step
        (folder / f"looped-rank{os.environ['RANK']}").touch()
        time.sleep(args.linger)
    save_weights(engine, folder / "final.safetensors")
    engine.destroy()
    reference = engine_for(config(**extra), DROPOUT, seed=0, model=model)
    for _ in range(args.steps):
        reference.train_batch()
    save_weights(reference, folder / "reference.safetensors")


def slow_writer(out: Path, seconds: float) -> None:
    """The background writer waits for a phase's signal, at most ``seconds``, before writing
    its file (a slow disk)."""
    write = storage._write_rank_file

    def slow(*args, **kwargs):
        deadline = time.monotonic() + seconds
        if threading.current_thread().name == "shardwise-checkpoint-writer":
            while not list(out.glob("*/signalled")) and time.monotonic() < deadline:
                time.sleep(0.05)
        return write(*args, **kwargs)

    storage._write_rank_file = slow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("phases", nargs="+")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--interval", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--linger", type=float, default=0.0, help="seconds after the loop")
    parser.add_argument("--async", dest="async_save", action="store_true")
    parser.add_argument("--slow-write", type=float, default=0.0, help="seconds per file")
    args = parser.parse_args()
    if args.slow_write:
        slow_writer(Path(args.out), args.slow_write)
    for spec in args.phases:
        phase(Path(args.out), spec, args)


if __name__ == "__main__":
    main()
