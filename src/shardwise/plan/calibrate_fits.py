"""The fits of ``shardwise plan --calibrate`` (calibrate.py): what the planner's model charges
turned into the terms that make it meet what was timed (a collective's latency and bandwidth,
a tensor- or context-parallel call's cost beyond its messages, the split backward's and the
update's fixed and per-size costs), each with its largest relative miss."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

from shardwise.plan import traffic
from shardwise.plan.calibrate_ops import CONTEXT, RING
from shardwise.plan.candidates import Layout


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


def cores() -> int:
    """Cores this process may run on (its affinity; a container's limit shows there)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def update_fit(per_rank: list) -> tuple[float, float]:
    """The update's (seconds per parameter tensor, bytes/s), the median rank's; an older
    calibration's single rate (one big tensor) has no per-tensor cost."""
    if per_rank and not isinstance(per_rank[0], list | tuple):
        return 0.0, statistics.median(per_rank)
    return statistics.median(t for t, _ in per_rank), statistics.median(b for _, b in per_rank)


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


def fit_error(xs: Sequence[float], ts: Sequence[float], lat: float, bw: float) -> float:
    """The largest relative error of the fit ``lat + x / bw`` at the measured points."""
    return max(abs(lat + x / bw - t) / t for x, t in zip(xs, ts, strict=True) if t > 0)


def tp_call_fit(
    ranks: list[dict], n: int, layer: float, all_reduce: list[float], wait: float | None = None
) -> tuple[float, float, float]:
    """(us per call, split-compute excess, fit error) of a tensor-parallel block beyond the
    ideal. The model without them predicts the split block as (full - layer) / n + layer +
    calls x all_reduce(payload); what the slowest rank measured beyond that is fitted, over
    the block sizes, as  calls x c + k x (full - layer) / n:  c per collective issued between
    kernels (waiting on the peer, a woken socket thread), k the share by which the split
    arithmetic runs slower than 1/n of the whole (narrower matmuls, the norms and residual
    adds every rank repeats). With ``wait`` (an all-reduce's, timed between compute
    segments: ``call_wait``) c is that and k alone is fitted: fitted together, the blocks'
    three sizes told c from k poorly (1144 then 416 us at 2 ranks a day apart, k making up
    the difference). The error is the model's largest relative miss with them."""
    lat, bw = all_reduce
    sizes = range(len(ranks[0]["tp_blocks"]))
    got = [{k: max(r["tp_blocks"][i][k] for r in ranks) for k in ("full", "tp")} for i in sizes]
    info = ranks[0]["tp_blocks"]
    calls = [b["calls"] for b in info]
    split = [(g["full"] - layer) / n for g in got]
    ring = RING["all_reduce"](n)
    comm_s = [c * (lat + ring * b["payload"] / bw) for c, b in zip(calls, info, strict=True)]
    extra = [g["tp"] - x - layer - m for g, x, m in zip(got, split, comm_s, strict=True)]
    times = [g["tp"] for g in got]
    if wait is None:
        c, k, miss = fit_excess(calls, split, extra, times)
        return c * 1e6, k, miss
    w = [1.0 / t**2 for t in times]
    rest = [e - m * wait for e, m in zip(extra, calls, strict=True)]
    k = max(_dot(w, split, rest) / max(_dot(w, split, split), 1e-30), 0.0)
    return wait * 1e6, k, _miss((wait, k), calls, split, extra, times)


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


def call_wait(ranks: list[dict], n: int, collectives: dict) -> float | None:
    """Seconds an all-reduce issued between compute segments waits beyond its fitted
    transfer, every rank busy (calibrate_ops.call_excess, the slowest rank's; 0 at least;
    None for an older calibration without it)."""
    timed = ranks[0].get("call_excess")
    if not timed:
        return None
    lat, bw = collectives["all_reduce"][str(n)]
    excess = max(r["call_excess"]["seconds"] for r in ranks)
    return max(excess - (lat + RING["all_reduce"](n) * timed["size"] / bw), 0.0)
