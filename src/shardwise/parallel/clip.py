"""The global gradient norm, each gradient element counted exactly once, and clipping by it.

    ||g|| = sqrt( sum over every element e of the model's gradient of g_e^2 )

A layout splits the model's gradient into pieces: replicated copies (plain data parallelism:
every rank holds the same full gradient), shards (ZeRO, tensor-parallel weights, pipeline
stages). ``global_grad_norm`` takes the tensors this rank *owns* (each element owned by
exactly one rank of ``group``) and sums their squares over ``group``; replicated copies
pass ``group=LOCAL`` so they are counted once. Clipping multiplies every gradient by
min(1, max_norm / (||g|| + 1e-6)), as torch.nn.utils.clip_grad_norm_ does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup

from shardwise import comm

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup

# The norm group of gradients that are complete on every rank: nothing to sum across ranks.
LOCAL = "local"


def local_sq_sum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of the given tensors, accumulated in fp32 (fp64 would cost bandwidth)."""
    # vector_norm reads each tensor once with no temporary (pow(2).sum() writes a gradient-sized
    # one: 3x slower on a 12M-parameter model, measured in benchmarks/README.md).
    norms = [
        torch.linalg.vector_norm(t.detach(), dtype=torch.float32) for t in tensors if t is not None
    ]
    if not norms:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([n.cpu() for n in norms]).square().sum()


def global_grad_norm(
    owned: Iterable[torch.Tensor],
    group: ProcessGroup | None = None,
    model_group: ProcessGroup | None = None,
) -> float:
    """sqrt of the sum over ``group`` of each rank's owned squared gradient elements.

    ``group`` is the data-parallel group (or LOCAL for replicated gradients); ``model_group``
    the ranks holding the other parts of the same model replica (pipeline stages,
    tensor-parallel slices), whose sums are added too. Parameters replicated across
    tensor-parallel ranks must be left out of ``owned`` on all but one of them.
    """
    sq = local_sq_sum(owned)
    if not (isinstance(group, str) and group == LOCAL):
        comm.all_reduce(sq, group=group)
    if model_group is not None:
        comm.all_reduce(sq, group=model_group)
    return float(sq.sqrt())


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor gradients are multiplied by; 1.0 when clipping is off or not needed."""
    if max_norm <= 0 or not torch.isfinite(torch.tensor(norm)):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def scale_grads(params: Iterable[torch.nn.Parameter], coef: float) -> None:
    if coef == 1.0:
        return
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
