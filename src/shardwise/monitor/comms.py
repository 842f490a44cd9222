"""DeepSpeed's ``comms_logger``: every profiled collective timed, summarized per op and size.

While the logger is on, ``shardwise.comm`` runs each profiled collective blocking (an async one
is waited for at once, as DeepSpeed synchronizes after each op so that the time is the op's
own) and books its latency under (op name, message size). ``isend``/``irecv`` are timed to
their posting only: waiting for them at once could deadlock a pipeline.

Message size is the op's payload as ``comm.stats()`` counts it (all-gather: the gathered
output; reduce-scatter: the whole input). Bandwidths follow nccl-tests' definitions, the ones
DeepSpeed cites, in Gbps (10^9 bits/s), for a payload of S bytes in t seconds on n ranks:

    algbw = S / t
    busbw = algbw * 2(n-1)/n   all_reduce
            algbw * (n-1)/n    all_gather, reduce_scatter, all_to_all
            algbw              broadcast, reduce, gather, scatter, send, recv, barrier

Averages drop the 10% highest and lowest samples (DeepSpeed's ``trim_mean(.., 0.1)``).
"""

from __future__ import annotations

import logging
import math
from datetime import datetime
from typing import Any

from shardwise.config.monitor import COMM_OPS, CommsLoggerConfig

logger = logging.getLogger("shardwise")
_BUS_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
_HEADER = (
    "Comm. Op",
    "Message Size",
    "Count",
    "Total Latency(ms)",
    "Avg Latency(ms)",
    "tput_avg (Gbps)",
    "busbw_avg (Gbps)",
)


def convert_size(size: int) -> str:
    """``1536`` -> ``"1.5 KB"`` (DeepSpeed's message-size format)."""
    if size == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(int(math.floor(math.log(size, 1024))), len(names) - 1)
    return f"{round(size / 1024**i, 2)} {names[i]}"


def bandwidths(op: str, size: int, ms: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbps (the module docstring)."""
    if ms <= 0:
        return 0.0, 0.0
    algbw = size * 8 / (ms * 1e6)
    factor = _BUS_FACTOR.get(op)
    return algbw, algbw * (factor * (n - 1) / n if factor else 1.0)


def trim_mean(values: list[float], trim: float = 0.1) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = int(round(len(ordered) * trim))
    kept = ordered[k : len(ordered) - k] or ordered
    return sum(kept) / len(kept)


def summary_result(summary: dict, world_size: int, rank: int) -> dict[str, Any]:
    """What DeepSpeed's ``log_summary(return_dict=True)`` returns around the per-op summary."""
    metadata = {"world_size": world_size, "rank": rank, "timestamp": datetime.now().isoformat()}
    return {"summary": summary, "straggler_analysis": None, "metadata": metadata}


class CommsLogger:
    """The booked latencies: ``{name: {size: [(ms, algbw, busbw), ...]}}``."""

    def __init__(self, cfg: CommsLoggerConfig, records: dict | None = None) -> None:
        self.config = cfg
        self.enabled = cfg.enabled
        self.verbose, self.debug, self.prof_all = cfg.verbose, cfg.debug, cfg.prof_all
        self.prof_ops = {COMM_OPS[op] for op in cfg.prof_ops}
        self.records: dict[str, dict[int, list[tuple[float, float, float]]]] = records or {}

    def wants(self, op: str) -> bool:
        return self.enabled and (self.prof_all or op in self.prof_ops)

    def record(self, op: str, size: int, ms: float, n: int, caller: str = "") -> None:
        name = f"{op} | [Caller Func: {caller}]" if self.debug else op
        algbw, busbw = bandwidths(op, size, ms, n)
        self.records.setdefault(name, {}).setdefault(size, []).append((ms, algbw, busbw))
        if self.verbose:
            logger.info(
                f"comm op: {name} | time (ms): {ms:.2f} | msg size: {convert_size(size)} | "
                f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}"
            )

    def summary(self) -> dict[str, dict[int, dict[str, Any]]]:
        """Per op and message size: count, total and mean latency, mean bandwidths."""
        out: dict[str, dict[int, dict[str, Any]]] = {}
        for name, sizes in self.records.items():
            for size, rows in sorted(sizes.items()):
                ms, alg, bus = (list(col) for col in zip(*rows, strict=True))
                out.setdefault(name, {})[size] = {
                    "count": len(rows),
                    "total_latency_ms": sum(ms),
                    "avg_latency_ms": trim_mean(ms),
                    "tput_avg_gbps": trim_mean(alg),
                    "busbw_avg_gbps": trim_mean(bus),
                    "msg_size_bytes": size,
                    "msg_size_str": convert_size(size),
                }
        return out

    def table(self) -> str:
        """DeepSpeed's summary table: a header, then each op and one row per message size."""
        lines = ["".join(f"{h: <20}" for h in _HEADER)]
        for name, sizes in self.summary().items():
            lines.append(name)
            for s in sizes.values():
                lines.append(
                    f"{' ': <20}{s['msg_size_str']: <20}{s['count']: <20}"
                    f"{s['total_latency_ms']: <20.2f}{s['avg_latency_ms']: <20.2f}"
                    f"{s['tput_avg_gbps']: <20.2f}{s['busbw_avg_gbps']: <20.2f}"
                )
        return "\n".join(lines)
