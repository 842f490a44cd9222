"""The asynchronous rows of checkpoint_io.py: shardwise's ``save_checkpoint(..., async_save=True)``
against ``torch.distributed.checkpoint.async_save`` (DCP), same engine, same state, same layout.

Not a script: checkpoint_io.py runs it in its launch. Three measurements:

- **blocking**: the time a save keeps the training thread (the call, timed between two
  barriers: the slowest rank), ``--blocking-samples`` per round, the contenders alternating
  which goes first; then the wait for the write, whose end-to-end time (call to durable) is
  reported beside it. Ours: the tag agreed, the directory locked, every
  piece copied to the reused staging buffers, the thread started. DCP: its default stager
  copies the state dict to new CPU tensors, then a thread plans and writes (FileSystemWriter).
  DCP gets a gloo group of its own (``process_group``), as ours has, so its background
  collectives never queue behind the training's.
- **step overhead**: blocks of ``every x intervals`` training steps, saving after the first
  step of each interval and waiting for the last save at the block's end (timed), against the
  same steps without saves: (t_saving - t_plain) / t_plain. Each save has ``every - 1`` steps
  to hide its write behind; at most one save in flight (ours waits by itself; DCP's future is
  waited before its next save, as its documentation asks).
- **resident memory**: a small model trained and saved ``warmup + saves`` times per contender
  (ours, then DCP, in the same processes), VmRSS (the largest over the ranks) after the first
  save, after the warm-up and at the end: the drift is end / after-warm-up - 1. No explicit
  garbage collection: what a training loop would see.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import format_table, make_batches, rss_mb

import shardwise


def barrier_timed(fn: Callable[[], object]) -> tuple[float, object]:
    """``fn()`` between two barriers: its time (the slowest rank's) and its result."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


class Trainer:
    """Steps of ``engine`` on fixed batches (each rank its row), and the two savers."""

    def __init__(self, engine: shardwise.Engine, seq: int, collect: Callable, root: str) -> None:
        self.engine, self.collect, self.root = engine, collect, root
        self.batches = make_batches(4, dist.get_world_size(), seq)
        self.dcp_group = dist.new_group(backend="gloo")  # DCP's background collectives
        self.future = None  # DCP's save in flight
        self.steps = 0

    def step(self) -> None:
        x, y = self.batches[self.steps % len(self.batches)]
        r = dist.get_rank()
        self.engine.backward(self.engine(x[r : r + 1], y[r : r + 1]))
        self.engine.step()
        self.steps += 1

    def save(self, who: str, name: str) -> None:
        """Start one asynchronous save (the previous one waited for first)."""
        if who == "ours":
            self.engine.save_checkpoint(os.path.join(self.root, "ours"), name, async_save=True)
            return
        self.wait("dcp")
        path = os.path.join(self.root, "dcp", name)
        self.future = dcp.async_save(
            self.collect(self.engine), checkpoint_id=path, process_group=self.dcp_group
        )

    def wait(self, who: str) -> None:
        if who == "ours":
            self.engine.wait_for_checkpoint()
        elif self.future is not None:
            self.future.result()
            self.future = None


def blocking_round(r: int, t: Trainer, samples: int, times: dict) -> None:
    """Each contender saves ``samples`` times, alternating which goes first: the blocking
    time, then the time to durable. Round 0 starts with an untimed save of each: ours
    allocates its staging buffers at its first save (once per run: a cost no later save
    pays); DCP allocates new ones at every save, which every timed save includes."""
    if r == 0:
        for who in ("ours", "dcp"):
            t.save(who, "warm-up")
            t.wait(who)
    for s in range(samples):
        for who in ("ours", "dcp") if (r + s) % 2 == 0 else ("dcp", "ours"):
            blocked, _ = barrier_timed(lambda who=who, s=s: t.save(who, f"blocking{s}"))
            waited, _ = barrier_timed(lambda who=who: t.wait(who))
            times.setdefault(f"{who} blocking", []).append(blocked)
            times.setdefault(f"{who} durable", []).append(blocked + waited)


def overhead_round(t: Trainer, every: int, intervals: int, times: dict) -> None:
    """One block per contender (none, ours, dcp): ``every * intervals`` steps, timed."""
    for who in ("none", "ours", "dcp"):

        def block(who: str = who) -> None:
            for j in range(every * intervals):
                t.step()
                if who != "none" and j % every == 0:
                    t.save(who, f"every{every}-{j // every}")
            if who != "none":
                t.wait(who)  # the last write's tail is part of the cost

        seconds, _ = barrier_timed(block)
        times.setdefault(f"{who} block", []).append(seconds)


def rss_run(t: Trainer, who: str, warmup: int, saves: int) -> dict[str, float]:
    """``warmup + saves`` steps, each followed by a save; VmRSS MiB (max over ranks)."""
    marks = {}
    for i in range(warmup + saves):
        t.step()
        t.save(who, f"rss{i % 2}")
        if i + 1 in (1, warmup, warmup + saves):
            t.wait(who)
            rss = torch.tensor([rss_mb("VmRSS")])
            dist.all_reduce(rss, op=dist.ReduceOp.MAX)
            marks[f"after {i + 1}"] = rss.item()
    return marks


def one_round(r: int, t: Trainer, args: argparse.Namespace, root: str, times: dict) -> None:
    """The blocking and overhead measurements of round ``r`` (checkpoint_io takes medians).
    A directory per round: checkpoint_io's loads take the step counter back, and a save
    refuses a directory holding later steps than its own."""
    t.root = os.path.join(root, "async", f"round{r}")
    blocking_round(r, t, args.blocking_samples, times)
    overhead_round(t, args.every, args.intervals, times)
    t.wait("dcp")
    dist.barrier()
    if dist.get_rank() == 0:  # untimed: the round's checkpoints
        shutil.rmtree(t.root)


def memory(
    args: argparse.Namespace, engine: shardwise.Engine, collect: Callable, root: str
) -> dict:
    """RSS marks of each contender (ours first: DCP's new buffers cannot inflate ours)."""
    t = Trainer(engine, args.seq, collect, root)
    return {who: rss_run(t, who, args.rss_warmup, args.rss_saves) for who in ("ours", "dcp")}


def report(results: dict[str, dict], every: int, intervals: int) -> str:
    rows = []
    for layout, m in results.items():
        plain = m["none block"]
        ours, theirs = m["ours block"] / plain - 1, m["dcp block"] / plain - 1
        rows.append([
            layout, f"{m['ours blocking']:.3f}", f"{m['dcp blocking']:.3f}",
            f"{m['ours blocking'] / m['dcp blocking']:.2f}",
            f"{m['ours durable']:.2f}", f"{m['dcp durable']:.2f}",
            f"{plain / (every * intervals):.3f}", f"{ours:+.1%}", f"{theirs:+.1%}",
            f"{m['ours block'] / m['dcp block']:.2f}",
        ])  # fmt: skip
    headers = ["layout", "blocking s ours", "blocking s DCP", "ours/DCP", "durable s ours",
               "durable s DCP", "step s, no saves", f"step overhead ours (save / {every})",
               "DCP", "steps + saves ours/DCP"]  # fmt: skip
    return format_table(headers, rows)


def rss_report(marks: dict[str, dict[str, float]], warmup: int) -> str:
    rows = []
    for who, m in marks.items():
        (first, warm, end), saves = m.values(), int(list(m)[-1].split()[-1]) - warmup
        per_save = (end - warm) / saves
        rows.append([who, f"{first:.0f}", f"{warm:.0f}", f"{end:.0f}", f"{end / warm - 1:+.2%}",
                     f"{per_save:+.3f}"])  # fmt: skip
    last = list(next(iter(marks.values())))[-1]
    headers = ["contender", "RSS MiB after 1", f"after {warmup}", last, "drift", "MiB per save"]
    return format_table(headers, rows)
