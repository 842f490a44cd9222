"""Synchronized batch normalization on any backend (gloo/CPU included).

The batch axis is split across the ranks of ``process_group``; statistics are taken over the
whole global batch. Legend: x is (N, C, *) with N_r samples on rank r; M = sum_r N_r * prod(*)
is the number of elements per channel in the global batch; sums below run over every axis but
C and over every rank.

Forward (training)::

    S1 = sum x,  S2 = sum x^2,  M        <- one all_reduce of cat(S1_r, S2_r, M_r): 2C + 1 values
    mean = S1 / M,   var = S2 / M - mean^2           (biased: what normalization uses)
    invstd = 1 / sqrt(var + eps),   xhat = (x - mean) * invstd,   y = w * xhat + b
    running_mean <- (1 - m) running_mean + m mean
    running_var  <- (1 - m) running_var  + m var * M / (M - 1)      (unbiased, as torch)

Backward, with dy the gradient of the sum over ranks of their losses::

    A = sum dy,   B = sum dy * xhat                  <- one all_reduce of cat(A_r, B_r): 2C values
    dx = w * invstd * (dy - A / M - xhat * B / M)
    dw = B_r,  db = A_r    (this rank's share: the data-parallel gradient reduction sums them)

Statistics are accumulated in at least fp32. ``S2/M - mean^2`` loses about
eps_fp32 * mean^2 / var of relative precision to cancellation, negligible for activations whose
mean is not thousands of standard deviations from zero. The count travels as a float: exact up
to 2**24 elements per channel, and off by at most 2**-24 relative beyond.

Eval mode uses the running statistics and communicates nothing; so does a group of one process,
which runs torch's own batch norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from shardwise import comm

if TYPE_CHECKING:  # annotations only
    from torch.autograd.function import FunctionCtx
    from torch.distributed import ProcessGroup


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]  # every axis but the channel axis C = 1


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(C,) -> (1, C, 1, ..., 1), broadcastable against x."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = w * (x - mean) * invstd + b with global statistics; returns (y, mean, var, count)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        group: ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = torch.promote_types(x.dtype, torch.float32)  # statistics in at least fp32
        dims, c = _reduce_dims(x), x.shape[1]
        xf = x.to(acc)
        local_count = torch.tensor([x.numel() // c], dtype=acc, device=x.device)
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), local_count])
        comm.all_reduce(stats, group=group)  # the forward's only collective
        count = stats[2 * c]  # a tensor: checking it on the host would sync a GPU
        mean = stats[:c] / count
        var = (stats[c : 2 * c] / count - mean * mean).clamp_(min=0)
        invstd = torch.rsqrt(var + eps)
        xhat = (xf - _per_channel(mean, x)) * _per_channel(invstd, x)
        y = xhat
        if weight is not None:
            y = y * _per_channel(weight.to(acc), x)
        if bias is not None:
            y = y + _per_channel(bias.to(acc), x)
        ctx.save_for_backward(x, weight, mean, invstd, count)
        ctx.group = group
        ctx.has_bias = bias is not None
        ctx.mark_non_differentiable(mean, var, count)
        return y.to(x.dtype), mean, var, count

    @staticmethod
    def backward(ctx: FunctionCtx, dy: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        x, weight, mean, invstd, count = ctx.saved_tensors
        acc, dims, c = mean.dtype, _reduce_dims(x), x.shape[1]
        # xhat is recomputed rather than saved: one activation-sized tensor less in memory.
        xhat = (x.to(acc) - _per_channel(mean, x)) * _per_channel(invstd, x)
        dyf = dy.to(acc)
        sums = torch.cat([dyf.sum(dims), (dyf * xhat).sum(dims)])  # local A_r, B_r
        grad_w = grad_b = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sums[c:].to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = sums[:c].to(weight.dtype if weight is not None else x.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            sums = sums.clone()  # the local slices above are the parameter gradients
            comm.all_reduce(sums, group=ctx.group)  # the backward's only collective
            mean_dy, mean_dy_xhat = sums[:c] / count, sums[c:] / count
            scale = invstd if weight is None else invstd * weight.to(acc)
            centered = dyf - _per_channel(mean_dy, x) - xhat * _per_channel(mean_dy_xhat, x)
            grad_x = (centered * _per_channel(scale, x)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of ``process_group`` (default: the world).

    The math is in the module docstring. Input (N, C, *) of any rank >= 2 (BatchNorm1d, 2d and
    3d alike); ranks may hold different N, even 0. Every rank of the group must call forward
    (and backward) in training mode together: each is one collective. The backward collective
    runs when the input requires a gradient, which must then be so on every rank.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input (N, C, *), got shape {tuple(x.shape)}")

    def _average_factor(self) -> float:
        """The running-statistics update weight (torch's rule, including momentum=None)."""
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got {x.shape[1]} channels")
        if not self.training or comm.get_world_size(self.process_group) <= 1:
            # Eval, or a group of one: torch's batch norm, no communication. Eval without
            # running statistics normalizes with this rank's batch alone, as torch's SyncBN.
            return F.batch_norm(
                x,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                self.training or self.running_mean is None,
                self._average_factor() if self.training and self.track_running_stats else 0.0,
                self.eps,
            )
        y, mean, var, count = _SyncBatchNormFunction.apply(
            x, self.weight, self.bias, self.eps, self.process_group
        )
        if self.track_running_stats:
            m = self._average_factor()
            with torch.no_grad():
                unbiased = var * (count / (count - 1).clamp(min=1))
                self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
        return y


def convert_sync_batchnorm(
    module: nn.Module, process_group: ProcessGroup | None = None
) -> nn.Module:
    """Replace every ``nn.BatchNorm*d`` in ``module`` by a ``SyncBatchNorm`` over the group.

    The new layers share the old parameters (so an optimizer built earlier still holds them),
    take over the running statistics and keep the training mode. Returns the converted module
    (a new object only when ``module`` itself is a batch norm).
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        new = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            new.weight, new.bias = module.weight, module.bias  # the same Parameter objects
        new.running_mean = module.running_mean
        new.running_var = module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        if hasattr(module, "qconfig"):
            new.qconfig = module.qconfig
        return new
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, process_group)
        if converted is not child:
            setattr(module, name, converted)
    return module
