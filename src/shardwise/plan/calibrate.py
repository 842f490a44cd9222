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

    optimizer   bytes of model state an AdamW step streams per second (params, grads and
                two moments: 16 bytes per element): ``optimizer_gbps``

The result is a ``Cluster``'s fields (a JSON preset: ``--cluster path.json``, or the default
path for ``--cluster this-machine``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.plan import traffic
from shardwise.plan.calibrate_ops import (
    CONTEXT,
    GEMM,
    OPS,
    RING,
    block_ops,
    block_time,
    cp_attention_times,
    gemm_rate,
    optimizer_rate,
    split_excess,
    time_op,
    tp_block_times,
    tp_blocks,
)
from shardwise.plan.candidates import Layout
from shardwise.plan.cluster import Cluster, default_calibration_path
from shardwise.spawn import spawn

SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)  # payload bytes, 1 KiB .. 4 MiB
REPEATS = 7
TINY_BLOCK = (8, 8)  # (tokens, hidden): a block whose time is all fixed costs
SPLIT_BLOCKS = (TINY_BLOCK, (512, 128))  # the split backward's cost: fixed, and per FLOP
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fit_line(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least squares ``t = a + x / bw`` with weights 1 / t^2 (relative error: the smallest
    payloads set the latency, the largest the bandwidth). Returns (a >= 0 s, bw bytes/s)."""
    if len(xs) != len(ts) or len(xs) < 2:
        raise ValueError("fit_line needs two or more (bytes, seconds) points")
    w = [1.0 / max(t, 1e-12) ** 2 for t in ts]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs, strict=True))
    st = sum(wi * t for wi, t in zip(w, ts, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts, strict=True))
    det = sw * sxx - sx * sx
    slope = (sw * sxt - sx * st) / det if det > 0 else 0.0
    a = (st - slope * sx) / sw
    if a < 0 or slope <= 0:  # noise: keep the physical form (no negative latency or speed)
        a = max(min(ts), 0.0) if slope <= 0 else 0.0
        slope = max(sum(wi * x * (t - a) for wi, x, t in zip(w, xs, ts, strict=True)) / sxx, 1e-15)
    return a, 1.0 / slope


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
    out["optimizer"] = optimizer_rate()
    dist.barrier()
    # (a block's forward weighted-product FLOPs, 24 tokens h^2; what splitting it cost)
    out["split"] = [(24.0 * t * h * h, split_excess((t, h), 2 * repeats)) for t, h in SPLIT_BLOCKS]
    for op in OPS if n > 1 else ():
        out["collectives"][op] = [time_op(op, size, repeats) for size in sizes]
    # Fits of a difference of two medians: more calls than a collective's best of few.
    many = 3 * repeats
    out["tp_blocks"] = [tp_block_times(g, many) for g in tp_blocks(gemm)] if n > 1 else []
    out["cp"] = [cp_attention_times(g, many) for g in tp_blocks(gemm)] if n > 1 else []
    return out


def run_world(
    n: int, sizes: Sequence[int], repeats: int, gemm: tuple[int, int] = GEMM
) -> list[dict]:
    """Every rank's measurements in a world of ``n`` local processes."""
    return spawn(_rank_work, n, args=(tuple(sizes), repeats, gemm), backend="gloo", timeout=600)


def cores() -> int:
    """Cores this process may run on (its affinity; a container's limit shows there)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
            us, tp_compute[str(n)], errors.setdefault("tp_block", {})[str(n)] = tp_call_fit(
                ranks, n, layer, collectives["all_reduce"][str(n)]
            )
            # Per core: what a call costs a step whatever the sharing (Cluster.call_wait).
            tp[str(n)] = us / max(1.0, n / cores())
    block = (statistics.median(eff), statistics.median(overhead))
    preset = _preset(compute, collectives, block, statistics.median(opt))
    extra = {"layer_overheads_us": overheads, "tp_call_us": tp, "tp_compute": tp_compute}
    extra |= cp_fits(worlds, compute["fp32"], collectives, errors)
    extra["layer_ops"] = float(block_ops(TINY_BLOCK))  # the fixed cost's block, its ops
    extra |= split_fit([r.get("split", 0.0) for r in worlds[min(worlds)]])
    return {**preset, **extra, "fit_errors": errors}


def split_fit(per_rank: list) -> dict[str, float]:
    """The split backward's cost with a core each (the smallest world's ranks, median):
    ``split_overhead_us`` per block and, timed at two sizes, ``split_flops_rate``: the cost
    grows by the block's weighted-product FLOPs / that rate (on the tiny block 0.3 ms; at 512
    tokens x 128, the example GPT's micro-batch of 4, 0.66 ms: the routed linears' saved
    inputs and the separate weight GEMMs cost with their size). A single time per rank (an
    older calibration's form) is the per-block cost alone."""
    if not per_rank or not isinstance(per_rank[0], list | tuple):
        return {"split_overhead_us": statistics.median(per_rank or [0.0]) * 1e6}
    fits = [fit_line([x for x, _ in r], [t for _, t in r]) for r in per_rank]
    return {
        "split_overhead_us": statistics.median(a for a, _ in fits) * 1e6,
        "split_flops_rate": statistics.median(rate for _, rate in fits),
    }


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


def fit_error(xs: Sequence[float], ts: Sequence[float], lat: float, bw: float) -> float:
    """The largest relative error of the fit ``lat + x / bw`` at the measured points."""
    return max(abs(lat + x / bw - t) / t for x, t in zip(xs, ts, strict=True) if t > 0)


def tp_call_fit(
    ranks: list[dict], n: int, layer: float, all_reduce: list[float]
) -> tuple[float, float, float]:
    """(us per call, split-compute excess, fit error) of a tensor-parallel block beyond the
    ideal. The model without them predicts the split block as (full - layer) / n + layer +
    calls x all_reduce(payload); what the slowest rank measured beyond that is fitted, over
    the block sizes, as  calls x c + k x (full - layer) / n:  c per collective issued between
    kernels (waiting on the peer, a woken socket thread), k the share by which the split
    arithmetic runs slower than 1/n of the whole (narrower matmuls, the norms and residual
    adds every rank repeats). The error is the model's largest relative miss with them."""
    lat, bw = all_reduce
    sizes = range(len(ranks[0]["tp_blocks"]))
    got = [{k: max(r["tp_blocks"][i][k] for r in ranks) for k in ("full", "tp")} for i in sizes]
    info = ranks[0]["tp_blocks"]
    calls = [b["calls"] for b in info]
    split = [(g["full"] - layer) / n for g in got]
    ring = RING["all_reduce"](n)
    comm_s = [c * (lat + ring * b["payload"] / bw) for c, b in zip(calls, info, strict=True)]
    extra = [g["tp"] - x - layer - m for g, x, m in zip(got, split, comm_s, strict=True)]
    c, k, miss = fit_excess(calls, split, extra, [g["tp"] for g in got])
    return c * 1e6, k, miss


def fit_excess(calls: list, split: list, extra: list, got: list) -> tuple[float, float, float]:
    """(c, k, largest relative miss) of the least-squares fit extra = calls c + split k
    (relative: weights 1 / got^2), both >= 0; ``got`` the measured seconds."""
    w = [1.0 / t**2 for t in got]
    a11, a12, a22 = _dot(w, calls, calls), _dot(w, calls, split), _dot(w, split, split)
    b1, b2 = _dot(w, calls, extra), _dot(w, split, extra)
    det = a11 * a22 - a12 * a12
    c, k = ((b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det) if det > 0 else (-1, -1)
    if c < 0 or k < 0:  # one term alone (the other would be negative): the better of the two
        only_c, only_k = (max(b1 / a11, 0.0), 0.0), (0.0, max(b2 / a22, 0.0))
        c, k = min(only_c, only_k, key=lambda ck: _miss(ck, calls, split, extra, got))
    return c, k, _miss((c, k), calls, split, extra, got)


def cp_fits(worlds: dict, rate: dict, collectives: dict, errors: dict) -> dict[str, dict]:
    """``cp_call_us`` and ``cp_compute`` per method and group size: what a context-parallel
    attention call (forward + backward, per micro-batch) costs beyond what the planner
    charges it, fitted over the timed shards as  c + k x arithmetic  (``cp_call_fit``)."""
    us: dict[str, dict] = {}
    ks: dict[str, dict] = {}
    for n, ranks in sorted(worlds.items()):
        for method in CONTEXT if n > 1 and ranks[0].get("cp") else ():
            fit = cp_call_fit(ranks, n, method, rate[str(n)] * 1e12, collectives)
            c, ks.setdefault(method, {})[str(n)], errors.setdefault(f"cp_{method}", {})[str(n)] = (
                fit
            )
            us.setdefault(method, {})[str(n)] = c * 1e6 / max(1.0, n / cores())
    return {"cp_call_us": us, "cp_compute": ks}


def cp_call_fit(
    ranks: list[dict], n: int, method: str, rate: float, collectives: dict
) -> tuple[float, float, float]:
    """(seconds per call, arithmetic excess, fit error) of context-parallel attention. The
    planner charges a call 3 n F / rate (the local block's F FLOPs, x n key blocks, forward
    + backward) plus its messages, asked of traffic.context_calls (ring, per call 4 (n-1)
    K/V blocks and 2 n fp32 dK/dV blocks sent; Ulysses, 8 all-to-alls of a block).
    What the slowest rank took beyond that is fitted as c + k x 3 n F / rate: c the waits on
    the neighbour and the merges' small ops, k how much slower than the GEMM rate the
    split attention runs."""
    info = ranks[0]["cp"]
    got = [max(r["cp"][i][method] for r in ranks) for i in range(len(info))]
    arith = [3 * n * b["flops"] / rate for b in info]

    layout = Layout(1, 1, 1, 0, 1, 1, cp=n, cp_method=method)

    def charged(payload: float) -> float:  # the planner's messages of one call, as fitted
        total = 0.0
        for c in traffic.context_calls([("attn", int(payload))], layout, "fp32", False):
            if c.op != "recv":
                lat, bw = collectives[c.op][str(n)]
                total += c.count * (lat + RING[c.op](n) * c.payload / bw)
        return total

    comm_s = [charged(b["payload"]) for b in info]
    extra = [g - a - m for g, a, m in zip(got, arith, comm_s, strict=True)]
    return fit_excess([1.0] * len(got), arith, extra, got)


def _dot(*vectors: list) -> float:
    """Sum over i of the product of every vector's i-th entry."""
    total = 0.0
    for items in zip(*vectors, strict=True):
        term = 1.0
        for v in items:
            term *= v
        total += term
    return total


def _miss(ck: tuple[float, float], calls: list, split: list, extra: list, got: list) -> float:
    """The largest relative miss of extra = calls c + split k at the measured blocks."""
    c, k = ck
    return max(
        abs(n * c + x * k - e) / t for n, x, e, t in zip(calls, split, extra, got, strict=True)
    )


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
) -> dict[str, Any]:
    """Measure worlds of each size in ``procs`` (module docstring); a preset's fields."""
    bad = [p for p in procs if not isinstance(p, int) or p < 1]
    if not procs or bad:
        raise ValueError(f"--calibrate-procs {list(procs)}: give process counts >= 1, like 1,2,4")
    if len(sizes) < 2 or any(s < 4 for s in sizes):
        raise ValueError(f"calibration sizes {list(sizes)}: give two or more payloads >= 4 bytes")
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
