"""Collectives and point-to-point over torch.distributed, each call counted.

Every function takes its process group explicitly (``group=None`` means the default group).
A group of one process, or no initialized torch.distributed at all, makes every call a local
no-op, so single-process code takes the same path as a parallel one.

Byte accounting (``stats()``): for each op, ``calls``, ``bytes`` (the payload: the size of the
tensor the caller passes, for all-gather the gathered output) and ``sent_bytes``, the bytes this
rank puts on the wire under the ring algorithms the theory uses. For a payload of S bytes on
N ranks:

    all_reduce       2 (N-1)/N * S
    reduce_scatter     (N-1)/N * S     (S = the full input)
    all_gather         (N-1)/N * S     (S = the full output)
    broadcast, reduce  (N-1)/N * S     (pipelined chain, amortized per rank)
    scatter            (N-1)/N * S on the root, 0 elsewhere (S = all chunks)
    gather             S/N on every rank but the root, 0 on the root
    send               S;  recv 0    (the ring's; gloo's reduce-scatter moves an all-reduce's bytes)

The flight recorder (``recorder()``, shardwise/diagnose/) keeps every call, so that a hang names
the call each rank is stuck in (docs/reliability.md, "Hangs"); errors name the call and group.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from shardwise.config.monitor import CommsLoggerConfig
from shardwise.diagnose.recorder import FlightRecorder, process_recorder
from shardwise.launch.env import init_distributed as _init
from shardwise.monitor.comms import CommsLogger, summary_result

ReduceOp = dist.ReduceOp
Group, Op = dist.ProcessGroup | None, ReduceOp.RedOpType  # group None: the default group


@dataclass
class CommLog:
    """Per-op counters and the flight recorder (this process only)."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    flight: FlightRecorder = field(default_factory=process_recorder)

    def record(self, op: str, payload: int, sent: float, group_size: int) -> None:
        entry = self.counts.setdefault(op, {"calls": 0, "bytes": 0, "sent_bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += int(payload)
        entry["sent_bytes"] += int(round(sent))


# The log is a process-wide record (like a profiler), not a process group: no group lives here.
_LOG = CommLog()
_PROFILER: Any = None  # the comms_logger's CommsLogger while one is configured on


def stats() -> dict[str, dict[str, int]]:
    """Per-op ``{"calls", "bytes", "sent_bytes"}`` since the last ``reset_stats()``."""
    return {op: dict(v) for op, v in _LOG.counts.items()}


def total_sent_bytes() -> int:
    """Bytes this rank sent, over all ops, under the ring model."""
    return sum(v["sent_bytes"] for v in _LOG.counts.values())


def reset_stats() -> None:
    """Clear the counters (the flight recorder's sequence numbers are never reset)."""
    _LOG.counts.clear()
    if _PROFILER is not None:
        _PROFILER.records.clear()


def configure(
    deepspeed_config: object = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """DeepSpeed's ``deepspeed.comm.configure``: the comms logger from a config's
    ``comms_logger`` block (every engine calls this with its own), then any keyword given."""
    global _PROFILER

    cfg = getattr(deepspeed_config, "comms_logger", deepspeed_config)
    if cfg is None:
        cfg = _PROFILER.config if _PROFILER is not None else CommsLoggerConfig()
    given = dict(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose)
    cfg = replace(cfg, **{k: v for k, v in {**given, "debug": debug}.items() if v is not None})
    kept = _PROFILER.records if _PROFILER is not None else {}
    _PROFILER = CommsLogger(cfg, kept) if cfg.enabled else None


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """DeepSpeed's ``deepspeed.comm.log_summary``: every rank waits for the others, rank 0
    prints the comms logger's table (op, message size, count, total and mean latency, algbw,
    busbw); with ``return_dict`` every rank returns its own numbers and ``metadata``."""
    if show_straggler:
        raise NotImplementedError("log_summary(show_straggler=True) is not available in shardwise")
    if is_initialized():
        dist.barrier()
    summary = _PROFILER.summary() if _PROFILER is not None else {}
    if get_rank() == 0:
        print(_PROFILER.table() if _PROFILER is not None else "comms_logger is not enabled")
    if is_initialized():
        dist.barrier()
    return summary_result(summary, get_world_size(), get_rank()) if return_dict else None


def recent_calls() -> list[tuple[float, str, int, int]]:
    """The last calls as (time, op, payload bytes, group size), oldest first."""
    return [(c.start, c.op, c.nbytes, len(c.group.ranks)) for c in _LOG.flight.recent()]


def recorder() -> FlightRecorder:
    """The flight recorder of this process (``configure`` it: size, watchdog, fingerprint)."""
    return _LOG.flight


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size(group: Group = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_rank(group: Group = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_global_rank(group: Group, group_rank: int) -> int:
    """The global rank of ``group_rank`` inside ``group``."""
    if not is_initialized() or group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))


def barrier(group: Group = None) -> None:
    if get_world_size(group) > 1:
        _LOG.record("barrier", 0, 0, get_world_size(group))
        _issue("barrier", 0, get_world_size(group), False, dist.barrier, group=group)


class _Done:
    """A completed work handle, returned when a call needs no communication."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _trivial(group: Group) -> tuple[bool, int]:
    n = get_world_size(group)
    return n == 1, n


def _issue(name: str, size: int, n: int, async_op: bool, fn: Any, /, *args: Any, **kw: Any) -> Any:
    """``fn`` (``group=`` by keyword) recorded; its errors name the call, group and diagnosis."""
    call = _LOG.flight.begin(name, size, args, kw)
    try:
        out = _timed(name, size, n, async_op, fn, *args, **kw)
    except RuntimeError as e:
        wrapped = _LOG.flight.failed(call, e)
        if wrapped is None:
            raise
        raise wrapped from e
    return _LOG.flight.finished(call, out)


def _timed(name: str, size: int, n: int, async_op: bool, fn: Any, /, *args: Any, **kw: Any) -> Any:
    """Call ``fn``; under the comms logger (``configure``), a profiled op runs blocking and its
    latency is booked (shardwise.monitor.comms), as DeepSpeed's ``timed_op`` does."""
    if async_op:
        kw["async_op"] = True
    prof = _PROFILER
    if prof is None or not prof.wants(name):
        return fn(*args, **kw)
    start = time.perf_counter()
    work = fn(*args, **kw)
    if async_op:
        work.wait()
    caller = sys._getframe(3).f_code.co_name if prof.debug else ""
    prof.record(name, size, (time.perf_counter() - start) * 1e3, n, caller)
    return _Done() if async_op else work


# ----------------------------------------------------------------------------- collectives


def all_reduce(
    tensor: torch.Tensor, op: Op = ReduceOp.SUM, group: Group = None, async_op: bool = False
) -> Any:
    """In place: every rank ends with the reduction of all ranks' ``tensor``."""
    trivial, n = _trivial(group)
    if trivial:
        return _Done() if async_op else None
    s = _nbytes(tensor)
    _LOG.record("all_reduce", s, 2 * (n - 1) / n * s, n)
    return _issue("all_reduce", s, n, async_op, dist.all_reduce, tensor, op=op, group=group)


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False) -> Any:
    """In place: every rank ends with global rank ``src``'s ``tensor``."""
    trivial, n = _trivial(group)
    if trivial:
        return _Done() if async_op else None
    s = _nbytes(tensor)
    _LOG.record("broadcast", s, (n - 1) / n * s, n)
    return _issue("broadcast", s, n, async_op, dist.broadcast, tensor, src=src, group=group)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Op = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """In place on global rank ``dst``: the reduction of all ranks' ``tensor``."""
    trivial, n = _trivial(group)
    if trivial:
        return _Done() if async_op else None
    s = _nbytes(tensor)
    _LOG.record("reduce", s, (n - 1) / n * s, n)
    return _issue("reduce", s, n, async_op, dist.reduce, tensor, dst=dst, op=op, group=group)


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False
) -> Any:
    """``output`` (N * input.numel()) = concatenation of every rank's ``input``, rank order."""
    trivial, n = _trivial(group)
    if trivial:
        output.copy_(input.reshape(output.shape))
        return _Done() if async_op else None
    s = _nbytes(output)
    _LOG.record("all_gather", s, (n - 1) / n * s, n)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _issue("all_gather", s, n, async_op, fn, output, input, group=group)


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """``tensor_list[i]`` = rank i's ``tensor``."""
    trivial, n = _trivial(group)
    if trivial:
        tensor_list[0].copy_(tensor)
        return _Done() if async_op else None
    s = _nbytes(tensor) * n
    _LOG.record("all_gather", s, (n - 1) / n * s, n)
    return _issue("all_gather", s, n, async_op, dist.all_gather, tensor_list, tensor, group=group)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Op = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """``output`` = rank r's 1/N slice of the reduction of every rank's ``input``."""
    trivial, n = _trivial(group)
    if trivial:
        output.copy_(input.reshape(output.shape))
        return _Done() if async_op else None
    s = _nbytes(input)
    _LOG.record("reduce_scatter", s, (n - 1) / n * s, n)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _issue("reduce_scatter", s, n, async_op, fn, output, input, op=op, group=group)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Op = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """``output`` = the reduction over ranks of their ``input_list[r]``."""
    trivial, n = _trivial(group)
    if trivial:
        output.copy_(input_list[0])
        return _Done() if async_op else None
    s = sum(_nbytes(t) for t in input_list)
    _LOG.record("reduce_scatter", s, (n - 1) / n * s, n)
    fn = dist.reduce_scatter
    return _issue("reduce_scatter", s, n, async_op, fn, output, input_list, op=op, group=group)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Group = None,
) -> None:
    """On global rank ``dst``: ``gather_list[i]`` = rank i's ``tensor``."""
    trivial, n = _trivial(group)
    if trivial:
        if gather_list:
            gather_list[0].copy_(tensor)
        return
    is_root = get_rank() == dst
    s = _nbytes(tensor) * n
    _LOG.record("gather", s, 0 if is_root else s / n, n)  # every other rank sends its chunk
    gl = gather_list if is_root else None
    _issue("gather", s, n, False, dist.gather, tensor, gl, dst=dst, group=group)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Group = None,
) -> None:
    """Rank i receives ``scatter_list[i]`` of global rank ``src`` into ``tensor``."""
    trivial, n = _trivial(group)
    if trivial:
        if scatter_list:
            tensor.copy_(scatter_list[0])
        return
    is_root = get_rank() == src
    s = _nbytes(tensor) * n
    _LOG.record("scatter", s, (n - 1) / n * s if is_root else 0, n)
    sl = scatter_list if is_root else None
    _issue("scatter", s, n, False, dist.scatter, tensor, sl, src=src, group=group)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Group = None,
    async_op: bool = False,
) -> Any:
    """Rank r sends its i-th chunk of ``input`` to rank i and receives into ``output``."""
    trivial, n = _trivial(group)
    if trivial:
        output.copy_(input)
        return _Done() if async_op else None
    s = _nbytes(input)
    _LOG.record("all_to_all", s, (n - 1) / n * s, n)
    splits = (output_split_sizes, input_split_sizes)
    fn = dist.all_to_all_single
    return _issue("all_to_all", s, n, async_op, fn, output, input, *splits, group=group)


# ----------------------------------------------------------------------------- point to point


def send(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> None:
    """Blocking send to global rank ``dst``."""
    _LOG.record("send", _nbytes(tensor), _nbytes(tensor), 2)
    _issue("send", _nbytes(tensor), 2, False, dist.send, tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0) -> int:
    """Blocking receive from global rank ``src`` into ``tensor``; returns the sender."""
    _LOG.record("recv", _nbytes(tensor), 0, 2)
    return _issue("recv", _nbytes(tensor), 2, False, dist.recv, tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> Any:
    _LOG.record("send", _nbytes(tensor), _nbytes(tensor), 2)
    # Timed to its posting only (comms_logger): waiting at once could deadlock a pipeline.
    return _issue("send", _nbytes(tensor), 2, False, dist.isend, tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0) -> Any:
    _LOG.record("recv", _nbytes(tensor), 0, 2)
    return _issue("recv", _nbytes(tensor), 2, False, dist.irecv, tensor, src, group=group, tag=tag)


def init_distributed(*args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's ``deepspeed.comm.init_distributed``: see ``shardwise.init_distributed``."""
    return _init(*args, **kwargs)
