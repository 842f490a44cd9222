"""A script's own ``torch.distributed`` calls and groups, covered like shardwise's.

Hang reports read the flight recorder, which ``shardwise.comm`` fills; a script that calls
``dist.all_reduce`` itself (a metric, a custom barrier, a group of its own) was invisible
there, and a group it made with ``dist.new_group`` kept torch's 30-minute default timeout
whatever ``--timeout`` said. ``cover_torch_distributed()`` (run by ``init_distributed`` once
the world is up) replaces the collective and point-to-point functions of the
``torch.distributed`` package by thin wrappers that book each call in the recorder exactly as
``shardwise.comm`` does (op, group, seq, shapes, bytes, the script's line) and then call
torch's function unchanged; ``dist.new_group`` without a ``timeout`` gets the world's.

``dist.P2POp`` is given torch's own ``isend``/``irecv`` when a script passes the covered ones
(torch checks ``op is isend``: Megatron's and torch pipelining's ``P2POp(dist.isend, ...)``
failed on the wrappers), and ``dist.batch_isend_irecv`` books each of its sends and receives.

What is not covered: a name bound before the world was set up (``from torch.distributed
import all_reduce`` at the top of a module keeps torch's function), and torch's own internal
calls (they go through ``torch.distributed.distributed_c10d`` directly). Calls from shardwise's
own modules pass straight through (``shardwise.comm`` has booked them already). The cost of a
wrapper is the recorder's (about 3 microseconds a call); ``comm.recorder().configure(size=0)``
turns the booking off, and ``SHARDWISE_COVER_TORCH_DISTRIBUTED=0`` leaves torch untouched.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardwise.diagnose.recorder import P2P, process_recorder
from shardwise.topology import world_timeout

SWITCH_VAR = "SHARDWISE_COVER_TORCH_DISTRIBUTED"
COVERED = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather",
    "scatter", "barrier", "send", "recv", "isend", "irecv", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list",
)  # fmt: skip
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # src/shardwise/
_MARK = "__shardwise_covered__"


def _tensors(arguments: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in arguments.values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.Tensor)]
    return found


def _booked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with each call from outside shardwise booked in the flight recorder."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        recorder = process_recorder()
        if not recorder.enabled or sys._getframe(1).f_code.co_filename.startswith(_OURS):
            return fn(*args, **kwargs)
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:  # torch's own error for a wrong call
            return fn(*args, **kwargs)
        tensors = _tensors(arguments)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if name in P2P or name in ("isend", "irecv"):
            peer = arguments.get("dst", arguments.get("src"))
            booked = ((tensors[0] if tensors else None), peer)
        else:
            booked = tuple(tensors)
        op = {"isend": "send", "irecv": "recv"}.get(name, name)
        record = recorder.begin(op, nbytes, booked, {"group": arguments.get("group")})
        try:
            out = fn(*args, **kwargs)
        except RuntimeError as e:
            wrapped = recorder.failed(record, e)
            if wrapped is None:
                raise
            raise wrapped from e
        return recorder.finished(record, out)

    setattr(call, _MARK, fn)
    return call


def _p2p_op(cls: type) -> type:
    """torch's ``P2POp`` taking the covered ``isend``/``irecv`` as torch's own."""

    class P2POp(cls):  # type: ignore[misc, valid-type]
        def __new__(klass, op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return super().__new__(klass, getattr(op, _MARK, op), *args, **kwargs)

        def __init__(self, op: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            super().__init__(getattr(op, _MARK, op), *args, **kwargs)

    P2POp.__doc__, P2POp.__module__ = cls.__doc__, cls.__module__
    setattr(P2POp, _MARK, cls)
    return P2POp


def _booked_batch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``batch_isend_irecv`` with each send and receive booked as ``isend``/``irecv`` are.
    Paired with its handle when torch returns one per op (gloo); a coalesced batch (NCCL)
    returns one handle, which closes the first record, the others at once."""

    @functools.wraps(fn)
    def batch_isend_irecv(p2p_op_list: list) -> Any:
        recorder = process_recorder()
        if not recorder.enabled or sys._getframe(1).f_code.co_filename.startswith(_OURS):
            return fn(p2p_op_list)
        records = [
            recorder.begin(
                "send" if getattr(op.op, "__name__", "") == "isend" else "recv",
                op.tensor.numel() * op.tensor.element_size(),
                (op.tensor, op.peer),
                {"group": op.group},
            )
            for op in p2p_op_list
        ]
        try:
            works = fn(p2p_op_list)
        except RuntimeError as e:
            errors = [recorder.failed(record, e) for record in records]
            raise next((w for w in errors if w is not None), e) from e
        if len(works) != len(records):
            for record in records[len(works) :]:
                recorder.finished(record, None)
        return [recorder.finished(r, w) for r, w in zip(records, works, strict=False)]

    setattr(batch_isend_irecv, _MARK, fn)
    return batch_isend_irecv


def _with_world_timeout(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``dist.new_group`` whose ``timeout`` defaults to the world's, not torch's 30 minutes."""

    @functools.wraps(fn)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("timeout") is None and len(args) < 2:
            kwargs["timeout"] = world_timeout()
        return fn(*args, **kwargs)

    setattr(new_group, _MARK, fn)
    return new_group


def cover_torch_distributed() -> bool:
    """Install the wrappers (module docstring); idempotent. False when switched off."""
    if os.environ.get(SWITCH_VAR, "1") == "0":
        return False
    for name in COVERED:
        fn = getattr(dist, name, None)
        if fn is not None and not hasattr(fn, _MARK):
            setattr(dist, name, _booked(name, fn))
    if not hasattr(dist.new_group, _MARK):
        dist.new_group = _with_world_timeout(dist.new_group)
    if not hasattr(dist.P2POp, _MARK):
        dist.P2POp = _p2p_op(dist.P2POp)
    if not hasattr(dist.batch_isend_irecv, _MARK):
        dist.batch_isend_irecv = _booked_batch(dist.batch_isend_irecv)
    return True


def uncover_torch_distributed() -> None:
    """Give ``torch.distributed`` its own functions back."""
    for name in (*COVERED, "new_group", "P2POp", "batch_isend_irecv"):
        fn = getattr(dist, name, None)
        if fn is not None and hasattr(fn, _MARK):
            setattr(dist, name, getattr(fn, _MARK))
