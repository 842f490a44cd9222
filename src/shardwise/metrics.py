"""Metrics reduced across ranks: sums, means and exact global ratios.

Every function here is a collective over ``group`` (``None``: the default group): all its
ranks must call it. In a group of one process, or without torch.distributed, it is local.
Pass the data-parallel group (``engine.mesh.dp_group``) when tensor or pipeline parallelism is
on: ranks of one data shard hold the same samples and must not be counted twice.

Python numbers are reduced in float64, exact for counts up to 2**53. Tensors are detached
copies (metrics carry no gradient); the caller's tensor is never modified.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardwise import comm

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup

Number = int | float


def _device(group: ProcessGroup | None) -> torch.device:
    """Where a reduction buffer must live for the group's backend (NCCL needs the GPU)."""
    if comm.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_buffer(value: object, group: ProcessGroup | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        dtype = value.dtype if value.is_floating_point() else torch.float64
        return value.detach().to(device=_device(group), dtype=dtype, copy=True)
    return torch.tensor(float(value), dtype=torch.float64, device=_device(group))


def all_reduce_sum(
    value: Number | torch.Tensor, group: ProcessGroup | None = None
) -> float | torch.Tensor:
    """sum over ranks of ``value``: a float for a number, a new tensor for a tensor."""
    t = _as_buffer(value, group)
    comm.all_reduce(t, group=group)
    return t.to(value.device) if isinstance(value, torch.Tensor) else t.item()


def all_reduce_mean(
    value: Number | torch.Tensor, group: ProcessGroup | None = None
) -> float | torch.Tensor:
    """(1/N) * sum over the N ranks of ``value``: the unweighted mean of per-rank values.

    With uneven shards the mean of per-rank means is not the global mean; use ``MeanMetric``
    (which weights by counts) for that.
    """
    total = all_reduce_sum(value, group)
    return total / comm.get_world_size(group)


class _Ratio:
    """sum_ranks numerator / sum_ranks denominator, accumulated locally, reduced in one call."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._num: torch.Tensor | float = 0.0
        self._den: torch.Tensor | float = 0.0

    def _add(self, num: Number | torch.Tensor, den: Number | torch.Tensor) -> None:
        # Tensors stay tensors (no .item() per step, which would sync a GPU every batch).
        if isinstance(num, torch.Tensor):
            num = num.detach().to(torch.float64)
        if isinstance(den, torch.Tensor):
            den = den.detach().to(torch.float64)
        self._num = self._num + num
        self._den = self._den + den

    def local(self) -> tuple[float, float]:
        """(numerator, denominator) of this rank alone."""
        return float(self._num), float(self._den)

    def compute(self, group: ProcessGroup | None = None) -> float:
        """The global ratio over every rank of ``group`` (a collective; ``nan`` if empty)."""
        device = _device(group)
        pair = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64).to(device) for v in (self._num, self._den)]
        )
        comm.all_reduce(pair, group=group)  # numerator and denominator in one collective
        num, den = pair.tolist()
        return num / den if den else float("nan")


class MeanMetric(_Ratio):
    """A weighted mean: ``update(value, weight)`` adds ``value * weight`` over ``weight``.

    ``compute(group)`` = sum_ranks sum(value * weight) / sum_ranks sum(weight): the exact
    global mean whatever each rank's number of samples.
    """

    def update(self, value: Number | torch.Tensor, weight: Number | torch.Tensor = 1) -> None:
        """Add ``value`` (for example a batch's mean loss) with ``weight`` (its sample count)."""
        self._add(value * weight, weight)


class Accuracy(_Ratio):
    """Global accuracy = sum_ranks correct / sum_ranks total: exact with uneven shards."""

    def update(self, correct: Number | torch.Tensor, total: Number | torch.Tensor) -> None:
        """Count ``correct`` right answers out of ``total`` samples."""
        self._add(correct, total)

    def update_logits(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Count top-1 hits of ``logits`` (N, classes) against ``target`` (N,)."""
        self._add((logits.argmax(dim=-1) == target).sum(), target.numel())
