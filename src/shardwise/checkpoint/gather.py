"""Small collectives of JSON values for the checkpoint code (never pickle): every rank's value,
rank 0's value, and a random number shared by the ranks."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import torch

from shardwise import comm

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup


def all_gather_json(obj: object, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, sent as JSON bytes (never pickle)."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    n = comm.get_world_size(group)
    if n == 1:
        return [json.loads(bytes(data.numpy()))]
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(n)]
    comm.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(n)]
    comm.all_gather(out, padded, group=group)
    return [json.loads(bytes(o[: int(s.item())].numpy())) for o, s in zip(out, sizes, strict=True)]


def broadcast_json(obj: object, group: ProcessGroup | None = None) -> Any:
    """Rank 0's ``obj`` on every rank (as JSON bytes)."""
    if comm.get_world_size(group) == 1:
        return obj
    return all_gather_json(obj, group)[0]


def shared_nonce(group: ProcessGroup | None = None) -> int:
    """A random number, the same on every rank (rank 0's)."""
    nonce = torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(time.time_ns()))
    comm.broadcast(nonce, src=comm.get_global_rank(group, 0), group=group)
    return int(nonce.item())
