"""Vocabulary-parallel embedding and cross-entropy (Megatron-LM §3, "Embedding").

The vocabulary V is split in n equal ranges of Vl = ceil(V / n) token ids; rank r holds ids
[r*Vl, (r+1)*Vl). When n does not divide V the last ranges run past V: padding, which no
token id reaches and which never changes a result.

VocabParallelEmbedding  E (V, C) split along its rows (the vocabulary). Each rank looks up the
    ids in its range, writes zeros for the others, and g all-reduces: every id is found on
    exactly one rank, so the sum is the ordinary lookup.

vocab_parallel_cross_entropy  for logits split along the vocabulary (the output of a
    column-parallel LM head, Z_r (N, Vl)):
        loss_i = log sum_v exp(z_iv) - z_i,t_i
    computed from n-times-smaller messages than the logits: the row max m_i (all-reduce MAX,
    for a stable exp), then one all-reduce SUM of the pair (sum_v exp(z_iv - m_i) over the
    rank's columns, z_i,t_i - m_i on the rank that holds t_i, 0 elsewhere). The full logits
    are never gathered. Backward is local: dloss_i/dz_iv = softmax_iv - [v == t_i], each rank
    for its own columns. Padded columns arrive as -inf (ColumnParallelLinear with
    ``pad_vocab``): exp gives 0, so they add nothing to the sum and get gradient 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import comm
from shardwise.parallel.flat import ceil_div
from shardwise.parallel.tensor import comm_ops
from shardwise.parallel.tensor.comm import reduce_from_tp
from shardwise.parallel.tensor.placement import set_placement, split_box

if TYPE_CHECKING:  # annotations only
    from torch.autograd.function import FunctionCtx
    from torch.distributed import ProcessGroup


class VocabParallelEmbedding(nn.Module):
    """E (V, C) split along the vocabulary (rows); output = g(masked local lookup)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group, self.tp, self.tp_rank = group, comm.get_world_size(group), comm.get_rank(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.local = ceil_div(num_embeddings, self.tp)
        self.start = self.tp_rank * self.local
        self.real = max(0, min(self.local, num_embeddings - self.start))  # ids this rank owns
        shape = (self.local, embedding_dim)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Embedding's init, N(0, 1) on the whole table, then this rank's rows."""
        full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype)
        full.normal_()
        if self.padding_idx is not None:
            full[self.padding_idx] = 0
        self.load_full(full.to(self.weight.device))

    def load_full(self, weight: torch.Tensor) -> None:
        """Take this rank's rows of the whole table ``weight`` (V, C); padding rows are 0."""
        local = weight.new_zeros(self.local, self.embedding_dim)
        local[: self.real] = weight.detach()[self.start : self.start + self.real]
        self.weight = nn.Parameter(local, requires_grad=self.weight.requires_grad)
        global_shape = (self.num_embeddings, self.embedding_dim)
        set_placement(self.weight, global_shape, split_box(global_shape, 0, self.tp_rank, self.tp))

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, group: ProcessGroup | None, name: str = "embedding"
    ) -> VocabParallelEmbedding:
        """This rank's vocabulary slice of ``embedding`` (weights copied, not shared)."""
        unsupported = {
            "max_norm": embedding.max_norm is not None,
            "scale_grad_by_freq": embedding.scale_grad_by_freq,
            "sparse": embedding.sparse,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(
                f"{name}: nn.Embedding options {bad} are not supported by the vocabulary-"
                "parallel embedding; turn them off or leave this module out of the plan"
            )
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            embedding.padding_idx,
            group=group,
            device="meta",
            dtype=embedding.weight.dtype,
        )
        layer.weight.requires_grad_(embedding.weight.requires_grad)
        layer.load_full(embedding.weight)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.real)
        local = (ids - self.start).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = (
            pad - self.start if pad is not None and 0 <= pad - self.start < self.real else None
        )
        out = F.embedding(local, self.weight, local_pad)  # (..., C), rows of other ranks wrong
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # ...so zero them (and their grads)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp}, "
            f"rows=[{self.start}, {self.start + self.real})"
        )


class _VocabParallelCE(torch.autograd.Function):
    """Per-row losses (N,) from local logits (N, Vl); see the module doc for the math."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: ProcessGroup | None,
        ignore_index: int,
    ) -> torch.Tensor:
        z = logits.float()  # the softmax in fp32 whatever the logits' dtype
        vl = z.size(-1)
        start = comm.get_rank(group) * vl
        m = _reduce(z.max(dim=-1).values, group, "max")
        z = z - m.unsqueeze(-1)  # every row's max is 0 now: exp cannot overflow
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + vl)
        idx = (target - start).masked_fill(~mine, 0)
        picked = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        picked = torch.where(mine, picked, torch.zeros_like(picked))  # not *: -inf * 0 is nan
        exp = z.exp_()
        sums = torch.stack([exp.sum(-1), picked])  # (2, N): one message for both sums
        sums = _reduce(sums, group)
        loss = torch.where(valid, sums[0].log() - sums[1], torch.zeros_like(picked))
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple:
        softmax, idx, mine, valid = ctx.saved_tensors
        g = softmax.clone()  # softmax - onehot(target), for this rank's columns only
        g.scatter_add_(-1, idx.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))
        g.mul_((grad * valid).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None


def _reduce(x: torch.Tensor, group: ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """``x`` all-reduced over ``group``: in place eagerly; under torch.compile a new tensor
    from the custom op (comm_ops.py), so a model compiled whole traces its loss too."""
    if torch.compiler.is_compiling():
        return comm_ops.all_reduce(x, comm_ops.group_name(group), op)
    comm.all_reduce(x, op=comm_ops.REDUCE_OPS[op], group=group)
    return x


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup | None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy(full_logits, target) from this rank's vocabulary slice of the logits.

    ``local_logits`` (..., Vl): columns [rank*Vl, (rank+1)*Vl) of the full (..., V) logits,
    vocabulary last; ``target`` (...) global token ids. ``reduction`` "mean" averages over
    the targets that are not ``ignore_index`` (as F.cross_entropy), "sum" adds, "none"
    returns the per-position losses (...).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: use 'mean', 'sum' or 'none'")
    if local_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(local_logits.shape)} and target {tuple(target.shape)}: the target "
            "must have the logits' shape without the last (vocabulary) dimension"
        )
    flat = local_logits.reshape(-1, local_logits.size(-1))
    loss = _VocabParallelCE.apply(flat, target.reshape(-1), group, ignore_index)
    if reduction == "none":
        return loss.view(target.shape).to(local_logits.dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / (target != ignore_index).sum()
    return total.to(local_logits.dtype)


class VocabParallelCrossEntropyLoss(nn.Module):
    """nn.CrossEntropyLoss over vocabulary-split logits (class dimension 1, as torch's; for
    2-D input (N, Vl) that is the last one)."""

    def __init__(
        self, group: ProcessGroup | None = None, ignore_index: int = -100, reduction: str = "mean"
    ) -> None:
        super().__init__()
        self.group, self.ignore_index, self.reduction = group, ignore_index, reduction

    @classmethod
    def from_module(
        cls, loss: nn.CrossEntropyLoss, group: ProcessGroup | None, name: str = "loss"
    ) -> VocabParallelCrossEntropyLoss:
        if loss.weight is not None or loss.label_smoothing:
            raise ValueError(
                f"{name}: class weights and label_smoothing are not supported by the "
                "vocabulary-parallel cross-entropy; remove them or leave the loss out of the plan"
            )
        return cls(group, loss.ignore_index, loss.reduction)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.dim() > 2:  # torch's (N, C, d1, ...) layout: move the classes last
            input = input.movedim(1, -1)
        return vocab_parallel_cross_entropy(
            input, target, self.group, self.ignore_index, self.reduction
        )

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}"
