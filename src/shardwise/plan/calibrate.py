"""``shardwise plan --calibrate``: measure this machine (compute, collectives) as a preset.

Every measurement runs in ``n`` local processes started by ``shardwise.spawn`` (torch's
process launcher, a FileStore rendezvous: no port), one thread each as ``shardwise run``
starts workers, all ranks busy at once, so a machine with fewer cores than processes shows
its sharing in the numbers:

    compute     per rank, TFLOP/s of fp32 (and bf16) GEMMs of transformer shapes,
                (tokens x h) @ (h x 3h), (h x 4h), (4h x h): 2 m k n FLOPs / best seconds
    layers      a pre-LN block's forward + backward at that size and at a tiny one (the
                median call, every rank busy), fitted t = overhead + FLOPs / rate per
                process count: ``layer_overheads_us`` (the fixed cost of a layer's ops,
                what dominates small micro-batches) and the block's rate,
                which is the preset's ``compute`` per process count (bf16: the bf16 GEMM
                rate x the fp32 block's share of the fp32 GEMM rate); the GEMM rates
                themselves become the peaks (MFU)
    collectives for each op (comm.py's, as the library issues them) and payload S, the
                best seconds t of one call (other jobs only add time); fitted (``fit_line``) to the ring model that
                cluster.Cluster.collective_time charges:

                    t = latency + r(op, n) x S / bandwidth
                    r = 2 (n-1)/n all-reduce, 1 send (a ping-pong's half), (n-1)/n others

    optimizer   the engine's update (the gradients' norm and clip scaling, an AdamW step),
                fitted t = tensors x c + 16 bytes x elements / rate (parameter, gradient,
                two moments): ``optimizer_tensor_us`` (c: the per-tensor kernels, timed on
                96 tiny tensors) and ``optimizer_gbps`` (four GPT blocks' weights, past the
                caches)
    call wait   an all-reduce between equal compute segments against the segments alone,
                beyond its fit: ``tp_call_us`` per group size (per core), every blocking
                call's wait and the TP block fit's per-call cost (calibrate_fits)
    start skew  how far apart the ranks leave a barrier: ``start_skew_us`` per count

The result is a ``Cluster``'s fields (a JSON preset: ``--cluster path.json``, or the default
path for ``--cluster this-machine``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.plan.calibrate_fits import (
    call_wait,
    cores,
    cp_fits,
    fit_error,
    fit_line,
    split_fit,
    tp_call_fit,
    update_fit,
)
from shardwise.plan.calibrate_ops import (
    GEMM,
    OPS,
    RING,
    barrier_skew,
    block_ops,
    block_time,
    call_excess,
    cp_attention_times,
    gemm_rate,
    split_excess,
    time_op,
    tp_block_times,
    tp_blocks,
    update_costs,
)
from shardwise.plan.cluster import Cluster, default_calibration_path
from shardwise.plan.idle import BUSY, wait_quiet
from shardwise.spawn import spawn

SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)  # payload bytes, 1 KiB .. 4 MiB
REPEATS = 7
CALL_BYTES = 1 << 14  # the payload of the calls timed between compute segments
TINY_BLOCK = (8, 8)  # (tokens, hidden): a block whose time is all fixed costs
SPLIT_BLOCKS = (TINY_BLOCK, (512, 128))  # the split backward's cost: fixed, and per FLOP
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _rank_work(rank: int, sizes: Sequence[int], repeats: int, gemm: tuple[int, int]) -> dict:
    """One rank's measurements (runs inside ``spawn``: the default group exists)."""
    n = dist.get_world_size()
    out: dict[str, Any] = {"collectives": {}}
    dist.barrier()  # every rank multiplies at once: cores are shared as in a run
    out["compute"] = {p: gemm_rate(DTYPES[p], gemm) for p in DTYPES}
    dist.barrier()
    # A block as measured and one too small to cost anything but its fixed per-op time.
    out["blocks"] = [block_time(gemm), block_time(TINY_BLOCK, repeats=2 * repeats)]
    dist.barrier()
    out["optimizer"] = update_costs(gemm[1])  # (s per tensor, bytes/s)
    dist.barrier()
    # (a block's forward weighted-product FLOPs, 24 tokens h^2; what splitting it cost)
    out["split"] = [(24.0 * t * h * h, split_excess((t, h), 2 * repeats)) for t, h in SPLIT_BLOCKS]
    for op in OPS if n > 1 else ():
        out["collectives"][op] = [time_op(op, size, repeats) for size in sizes]
    # Fits of a difference of two medians: more calls than a collective's best of few.
    many = 3 * repeats
    out["tp_blocks"] = [tp_block_times(g, many) for g in tp_blocks(gemm)] if n > 1 else []
    out["cp"] = [cp_attention_times(g, many) for g in tp_blocks(gemm)] if n > 1 else []
    out["call_excess"] = {"size": CALL_BYTES, "seconds": call_excess(CALL_BYTES)} if n > 1 else {}
    out["barrier_skew"] = barrier_skew() if n > 1 else 0.0
    return out


def run_world(
    n: int, sizes: Sequence[int], repeats: int, gemm: tuple[int, int] = GEMM
) -> list[dict]:
    """Every rank's measurements in a world of ``n`` local processes."""
    return spawn(_rank_work, n, args=(tuple(sizes), repeats, gemm), backend="gloo", timeout=600)


def summarize(worlds: dict[int, list[dict]], sizes: Sequence[int]) -> dict[str, Any]:
    """A ``Cluster``'s fields from each world's per-rank measurements: per process count,
    the sustained rate of a transformer block (the slowest rank's: it paces a synchronous
    step), in bf16 the bf16 GEMM rate x the same efficiency, and a layer's fixed cost (the
    median rank's); the optimizer's speed from the smallest world (unshared cores, if there
    are enough)."""
    compute: dict[str, dict[str, float]] = {p: {} for p in DTYPES}
    collectives: dict[str, dict[str, list[float]]] = {}
    tp: dict[str, float] = {}
    tp_compute: dict[str, float] = {}
    errors: dict[str, dict[str, float]] = {}
    eff, opt, overhead = [], [], []
    overheads: dict[str, float] = {}
    for n, ranks in sorted(worlds.items()):
        fits = [fit_line(*zip(*r["blocks"], strict=True)) for r in ranks]
        ratio = [rate / r["compute"]["fp32"] for (_, rate), r in zip(fits, ranks, strict=True)]
        for prec in compute:
            rates = [r["compute"][prec] * e for r, e in zip(ranks, ratio, strict=True)]
            compute[prec][str(n)] = min(rates) / 1e12
        overheads[str(n)] = statistics.median(a for a, _ in fits) * 1e6
        if n == min(worlds):
            overhead, eff = [a for a, _ in fits], ratio
            opt = [r["optimizer"] for r in ranks]
        for op in ranks[0]["collectives"]:
            ring = RING[op](n)
            slowest = [max(r["collectives"][op][i] for r in ranks) for i in range(len(sizes))]
            lat, bw = fit_line([ring * s for s in sizes], slowest)
            collectives.setdefault(op, {})[str(n)] = [lat, bw]
            errors.setdefault(op, {})[str(n)] = fit_error(
                [ring * s for s in sizes], slowest, lat, bw
            )
        if n > 1:
            layer = statistics.median(a for a, _ in fits)
            tp[str(n)], tp_compute[str(n)] = _call_costs(ranks, n, layer, collectives, errors)
    block = (statistics.median(eff), statistics.median(overhead))
    per_tensor, opt_bps = update_fit(opt)
    preset = _preset(compute, collectives, block, opt_bps)
    extra = {
        "optimizer_tensor_us": per_tensor * 1e6,
        "layer_overheads_us": overheads,
        "tp_call_us": tp,
        "tp_compute": tp_compute,
        "start_skew_us": {
            str(n): 1e6 * statistics.median(r.get("barrier_skew", 0.0) for r in ranks)
            for n, ranks in worlds.items()
            if n > 1
        },
    }
    extra |= cp_fits(worlds, compute["fp32"], collectives, errors)
    extra["layer_ops"] = float(block_ops(TINY_BLOCK))  # the fixed cost's block, its ops
    extra |= split_fit([r.get("split", 0.0) for r in worlds[min(worlds)]])
    return {**preset, **extra, "fit_errors": errors}


def _call_costs(
    ranks: list[dict], n: int, layer: float, collectives: dict, errors: dict
) -> tuple[float, float]:
    """(tp_call_us, tp_compute) of a world of ``n``: the tensor-parallel block's excess with
    the all-reduce's wait between compute segments (``call_wait``) as its per-call cost.
    The wait is stored per core (÷ n / cores: what a call costs a step whatever the
    sharing, Cluster.call_wait)."""
    wait = call_wait(ranks, n, collectives)
    us, k, errors.setdefault("tp_block", {})[str(n)] = tp_call_fit(
        ranks, n, layer, collectives["all_reduce"][str(n)], wait
    )
    return us / max(1.0, n / cores()), k


def describe_errors(data: dict[str, Any]) -> str:
    """One line per fit: its largest relative error per group size, and the per-call cost
    of tensor-parallel collectives the split block showed."""
    errors = data.get("fit_errors", {})
    lines = ["fit errors (largest relative miss at the measured points):"]
    for name in sorted(errors):
        per = ", ".join(
            f"{n} procs {e:.0%}" for n, e in sorted(errors[name].items(), key=lambda x: int(x[0]))
        )
        lines.append(f"  {name:15s} {per}")
    tp, k = data.get("tp_call_us", {}), data.get("tp_compute", {})
    if tp:
        per = ", ".join(
            f"{n} procs {us:.0f} us, split arithmetic x {1 + k.get(n, 0.0):.2f}"
            for n, us in sorted(tp.items(), key=lambda x: int(x[0]))
        )
        lines.append(f"  tensor parallelism beyond the ideal: per call {per}")
    cp, k = data.get("cp_call_us", {}), data.get("cp_compute", {})
    for method, by_n in sorted(cp.items()):
        per = ", ".join(
            f"{n} procs {us:.0f} us, arithmetic x {1 + k.get(method, {}).get(n, 0.0):.2f}"
            for n, us in sorted(by_n.items(), key=lambda x: int(x[0]))
        )
        lines.append(f"  context ({method}) beyond the ideal: per attention call {per}")
    return "\n".join(lines)


def _preset(compute: dict, collectives: dict, block: tuple[float, float], opt_bps: float) -> dict:
    c = cores()
    ref = collectives.get("all_gather", {})
    lat, bw = ref[min(ref, key=int)] if ref else (50e-6, 1e9)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # Peaks (MFU's denominator): the best sustained rate / the efficiency, a GEMM's rate.
    fp32 = max(compute["fp32"].values()) / block[0]
    bf16 = max(compute["bf16"].values()) / block[0]
    machine = Cluster(
        "this-machine",
        procs_per_node=c,
        device_memory=ram // c,
        peak_tflops=bf16,
        fp32_tflops=fp32,
        intra_gbps=bw / 1e9,
        inter_gbps=bw / 1e9,
        latency_us=lat * 1e6,
        efficiency=1.0,  # the measured rates are a block's already
        layer_overhead_us=block[1] * 1e6,
        overlap=0.0,  # gloo's copies and sums run on the same busy cores as backward
        optimizer_gbps=opt_bps / 1e9,
        host_gbps=opt_bps / 1e9,  # offload moves between host memory and host memory
        host_optimizer_gbps=opt_bps / 1e9,
        collectives=collectives,
        compute=compute,
        cores=c,
    )
    return json.loads(machine.to_json())


def measure(
    procs: Sequence[int],
    sizes: Sequence[int] = SIZES,
    repeats: int = REPEATS,
    progress: Callable[[str], None] | None = None,
    gemm: tuple[int, int] = GEMM,
    quiet_s: float = 60.0,
) -> dict[str, Any]:
    """Measure worlds of each size in ``procs`` (module docstring); a preset's fields. First
    waits up to ``quiet_s`` for idle cores, and warns if they stay busy (idle.py)."""
    bad = [p for p in procs if not isinstance(p, int) or p < 1]
    if not procs or bad:
        raise ValueError(f"--calibrate-procs {list(procs)}: give process counts >= 1, like 1,2,4")
    if len(sizes) < 2 or any(s < 4 for s in sizes):
        raise ValueError(f"calibration sizes {list(sizes)}: give two or more payloads >= 4 bytes")
    busy = wait_quiet(quiet_s) if quiet_s > 0 else 0.0
    if busy > BUSY:
        warnings.warn(
            f"calibration: the cores were {busy:.0%} busy with other jobs after waiting "
            f"{quiet_s:.0f} s; a calibration that shares them measures them too (one taken "
            "during a test run came out 3x slow): run --calibrate on an idle machine",
            stacklevel=2,
        )
    worlds = {}
    for n in sorted(set(procs)):
        start = time.perf_counter()
        worlds[n] = run_world(n, sizes, repeats, gemm)
        if progress:
            progress(f"measured {n} process(es) in {time.perf_counter() - start:.1f} s")
    return summarize(worlds, sizes)


def check_output(path: str | os.PathLike | None) -> Path:
    """Where ``save`` writes; ``ValueError`` naming ``--output`` if it cannot be a file."""
    target = Path(path) if path else default_calibration_path()
    if target.is_dir():
        raise ValueError(f"--output {str(target)!r} is a directory: give a file like calib.json")
    if target.suffix != ".json":
        raise ValueError(f"--output {str(target)!r}: give a .json file (--cluster reads JSON)")
    return target


def save(data: dict[str, Any], path: str | os.PathLike | None) -> Path:
    """Write the preset JSON (``--output``, else the path ``--cluster this-machine`` reads)."""
    target = check_output(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(target)  # atomic: a planner reading it never sees half a file
    return target
