"""Column- and row-parallel linear layers (Megatron-LM, arXiv 1909.08053 §3).

A linear layer computes Y = X A + b, X (..., in), A (in, out), b (out,); ``nn.Linear`` stores
W = A^T of shape (out, in). On a tensor-parallel group of n ranks, r this rank:

ColumnParallelLinear  A split along its columns (the output features): A = [A_1 | ... | A_n],
    rank r holds A_r (in, out/n), i.e. rows r*out/n .. of W, and b_r. Forward Y_r = X A_r + b_r
    on a replicated X; the input passes through f (identity forward, all-reduce backward: the
    gradient dL/dX = sum_r dL/dY_r A_r^T is a sum over the ranks' slices). The output stays
    split (Y_r, feeding a row-parallel layer or a vocabulary-parallel loss) or, with
    ``gather_output``, is all-gathered along the last dimension.

RowParallelLinear  A split along its rows (the input features): A = [A_1; ...; A_n], rank r
    holds A_r (in/n, out), i.e. columns r*in/n .. of W. Its input X_r (..., in/n) is rank r's
    slice of the features (the output of a column layer), so Y = sum_r X_r A_r + b: the
    partial products pass through g (all-reduce forward, identity backward) and the bias,
    whole on every rank (replicated), is added once after the sum.

A column layer followed by a row layer (attention, MLP) communicates once each way.

Sequence parallelism (``sequence_parallel=True``, Korthikanti et al. §4.2): between the TP
regions the activations are split along the sequence (dim ``seq_dim`` of (B, T, C)), so the
column layer all-gathers its input (backward: reduce-scatter) and the row layer
reduce-scatters its output instead of all-reducing it (backward: all-gather). The row
layer's bias is then applied to a sequence shard: its gradient is summed over the group.

Column layers that read the same tensor (q, k, v) can share one f / one all-gather through a
``SharedInput``, so an attention block communicates once, as a fused qkv layer would.

Vocabulary padding (``pad_vocab``, the LM head split by vocabulary): the output features are
rounded up to a multiple of n; padded rows hold zeros and their logits are -inf, so a softmax
(or the vocabulary-parallel cross-entropy) gives them probability 0 and gradient 0.

Packed outputs (``packs`` k, a fused q|k|v): A's columns are k parts end to end,
A = [Q | K | V]; a column layer splits each part, rank r holds [Q_r | K_r | V_r] and computes
q_r | k_r | v_r, which the attention reshapes into its local heads. GPT-2's ``Conv1D`` stores A
itself (in, out) rather than W = A^T: ``transposed`` layers keep that storage.

Every parameter records which box of the global (unsplit) tensor it holds (tensor/placement.py; a
packed one, which is not one box, in the packed view).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import comm
from shardwise.parallel.flat import ceil_div
from shardwise.parallel.tensor.comm import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
    sum_grad_over_tp,
)
from shardwise.parallel.tensor.placement import packed_split_box, set_placement, split_box

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup


class SharedInput:
    """Layers reading one tensor share its preparation (f or the sequence all-gather).

    Keyed by the input's identity (and the grad mode): q, k and v called on the same ``x``
    reuse the first one's result, so autograd sums their input gradients before the single
    backward collective. An entry lives as long as the Python object ``x`` (a weak reference
    whose callback drops it), i.e. while the caller still uses ``x``.
    """

    def __init__(self) -> None:
        self._slots: dict[Any, tuple[weakref.ref, torch.Tensor]] = {}

    def prepare(
        self, x: torch.Tensor, kind: Any, make: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        key = (kind, torch.is_grad_enabled())
        slot = self._slots.get(key)
        if slot is not None and slot[0]() is x:
            return slot[1]
        out = make(x)
        self._slots[key] = (weakref.ref(x, lambda ref, key=key: self._drop(key, ref)), out)
        return out

    def clear(self) -> None:
        """Forget every entry (a compiled block starts each call with none: parallel/compile.py)."""
        self._slots.clear()

    def _drop(self, key: Any, ref: weakref.ref) -> None:
        slot = self._slots.get(key)
        if slot is not None and slot[0] is ref:
            del self._slots[key]

    # A copy of a model (deepcopy, pickle) starts with no entries: they belong to one forward.
    def __deepcopy__(self, memo: dict) -> SharedInput:
        return SharedInput()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._slots = {}


def _local_rows(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s ``size`` indices along ``dim`` of ``full``, zero-padded past its end."""
    start = rank * size
    real = max(0, min(size, full.shape[dim] - start))
    shape = list(full.shape)
    shape[dim] = size
    out = full.new_zeros(shape)
    out.narrow(dim, 0, real).copy_(full.detach().narrow(dim, start, real))
    return out


def _uniform_full(shape: tuple[int, ...], fan_in: int, like: torch.Tensor) -> torch.Tensor:
    """nn.Linear's default init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), on the whole tensor: a
    rank then takes its slice, so the split layer starts as the unsplit one would."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return torch.empty(shape, dtype=like.dtype, device=like.device).uniform_(-bound, bound)


def linear_dims(module: nn.Module) -> tuple[int, int, bool] | None:
    """``(in_features, out_features, transposed)`` of an ``nn.Linear`` (weight (out, in)) or of a
    GPT-2 style ``Conv1D`` (weight stored as A itself, (in, out): ``transposed``); None for any
    other module. Conv1D is recognised by its name and shape, without importing transformers."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):
        if tuple(weight.shape) == (nx, nf):
            return nx, nf, True
    return None


def _local_packed(full: torch.Tensor, dim: int, rank: int, size: int, packs: int) -> torch.Tensor:
    """Rank ``rank``'s slice of each of ``packs`` parts packed along ``dim``, end to end."""
    if packs == 1:
        return _local_rows(full, dim, rank, size)
    parts = full.detach().chunk(packs, dim)
    return torch.cat([_local_rows(p, dim, rank, size // packs) for p in parts], dim)


class _ParallelLinear(nn.Module):
    """What both splits share: group, sizes, parameters built from full tensors.

    The weight is stored as the layer it replaces stores it: W (out, in) for nn.Linear, A
    (in, out) for a Conv1D (``transposed``); ``packs`` parts packed along the outputs (a fused
    q|k|v) are each split, so rank r holds q_r | k_r | v_r."""

    split_dim = 0  # the dimension of W (out, in) this layer splits

    def _setup(
        self, group: ProcessGroup | None, in_f: int, out_f: int, bias: bool, factory: dict
    ) -> None:
        self.group, self.tp, self.tp_rank = group, comm.get_world_size(group), comm.get_rank(group)
        self.in_features, self.out_features = in_f, out_f
        full = (out_f, in_f)
        self.local = ceil_div(full[self.split_dim], self.tp)  # rounded up: padding when needed
        shape = (self.local, in_f) if self.split_dim == 0 else (out_f, self.local)
        shape = shape[::-1] if self.transposed else shape
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        bias_len = self.local if self.split_dim == 0 else out_f
        self.bias = nn.Parameter(torch.empty(bias_len, **factory)) if bias else None

    @property
    def _weight_dim(self) -> int:
        """The dimension of the stored weight that this layer splits."""
        return 1 - self.split_dim if self.transposed else self.split_dim

    def _full_shape(self) -> tuple[int, int]:
        full = (self.out_features, self.in_features)
        return full[::-1] if self.transposed else full

    def _w(self) -> torch.Tensor:
        """W (out/n, in) or (out, in/n), whatever the storage."""
        return self.weight.t() if self.transposed else self.weight

    @classmethod
    def from_linear(
        cls, linear: nn.Module, group: ProcessGroup | None, **kwargs: Any
    ) -> _ParallelLinear:
        """This rank's slice of ``linear`` (an nn.Linear or a Conv1D; weights copied)."""
        dims = linear_dims(linear)
        if dims is None:
            raise ValueError(f"{type(linear).__name__} is neither nn.Linear nor a Conv1D")
        in_f, out_f, transposed = dims
        layer = cls(
            in_f,
            out_f,
            linear.bias is not None,
            group=group,
            device="meta",
            dtype=linear.weight.dtype,
            transposed=transposed,
            **kwargs,
        )
        layer.weight.requires_grad_(linear.weight.requires_grad)
        layer.load_full(linear.weight, linear.bias)
        return layer

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Take this rank's slices of the whole layer's ``weight`` (as stored) and ``bias``."""
        d, r, n, k = self._weight_dim, self.tp_rank, self.local, self.packs
        grad = self.weight.requires_grad
        self.weight = nn.Parameter(_local_packed(weight, d, r, n, k), requires_grad=grad)
        if self.bias is not None and bias is not None:
            column = self.split_dim == 0
            b = _local_packed(bias, 0, r, n, k) if column else bias.detach().clone()
            self.bias = nn.Parameter(b, requires_grad=self.bias.requires_grad)
        self._place()

    def reset_parameters(self) -> None:
        w = _uniform_full(self._full_shape(), self.in_features, self.weight)
        b = None
        if self.bias is not None:
            b = _uniform_full((self.out_features,), self.in_features, self.weight)
        with torch.no_grad():
            self.load_full(w, b)

    def _place(self) -> None:
        full, d, k = self._full_shape(), self._weight_dim, self.packs
        if k > 1:
            box = packed_split_box(full, d, k, self.tp_rank, self.tp)
            set_placement(self.weight, full, box, packed=(d, k))
        else:
            set_placement(self.weight, full, split_box(full, d, self.tp_rank, self.tp))
        if self.bias is None:
            return
        out = (self.out_features,)
        if self.split_dim == 0 and k > 1:
            box = packed_split_box(out, 0, k, self.tp_rank, self.tp)
            set_placement(self.bias, out, box, packed=(0, k))
        elif self.split_dim == 0:
            set_placement(self.bias, out, split_box(out, 0, self.tp_rank, self.tp))
        else:
            set_placement(self.bias, out, ((0, self.out_features),), True)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp={self.tp}, tp_rank={self.tp_rank}, "
            f"sequence_parallel={self.sequence_parallel}"
            + (", transposed (Conv1D)" if self.transposed else "")
            + (f", packs={self.packs}" if self.packs > 1 else "")
        )


def _not_divisible(name: str, what: str, size: int, tp: int, fix: str) -> ValueError:
    return ValueError(
        f"{name}: {what} {size} is not divisible by the tensor-parallel size {tp}; {fix}"
    )


class ColumnParallelLinear(_ParallelLinear):
    """Y_r = X A_r + b_r: A (in, out) split along its columns (W's rows), see the module doc."""

    split_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: ProcessGroup | None = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        pad_vocab: bool = False,
        shared_input: SharedInput | None = None,
        packs: int = 1,
        transposed: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str = "ColumnParallelLinear",
    ) -> None:
        super().__init__()
        tp = comm.get_world_size(group)
        if out_features % tp and not pad_vocab:
            fix = "choose a size that divides it, or split another layer"
            raise _not_divisible(name, "out_features", out_features, tp, fix)
        if packs > 1 and (out_features % (packs * tp) or gather_output or pad_vocab):
            raise ValueError(
                f"{name}: {packs} packed parts of {out_features} outputs need each part "
                f"divisible by the tensor-parallel size {tp}, and no gathered or vocabulary "
                "output (packed_colwise feeds a module that splits its output itself)"
            )
        self.packs, self.transposed = packs, transposed
        self._setup(group, in_features, out_features, bias, {"device": device, "dtype": dtype})
        self.gather_output, self.sequence_parallel, self.seq_dim = (
            gather_output,
            sequence_parallel,
            seq_dim,
        )
        self.shared_input = shared_input
        # Output features of the real (unpadded) layer that this rank computes.
        self.real_out = max(0, min(self.local, out_features - self.tp_rank * self.local))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            kind = ("sequence", self.seq_dim)
            make = lambda t: gather_from_sequence(t, self.group, self.seq_dim)  # noqa: E731
        else:
            kind = "f"
            make = lambda t: copy_to_tp(t, self.group)  # noqa: E731
        if self.shared_input is None:
            return make(x)
        return self.shared_input.prepare(x, kind, make)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self._input(x), self._w(), self.bias)  # (.., in) @ (in, out/n)
        if self.real_out < self.local:  # padded vocabulary rows: probability 0, gradient 0
            pad = torch.arange(self.local, device=y.device) >= self.real_out
            y = y.masked_fill(pad, float("-inf"))
        if self.gather_output:
            y = gather_from_tp(y, self.group, -1)[..., : self.out_features]
        return y


class RowParallelLinear(_ParallelLinear):
    """Y = sum_r X_r A_r + b: A (in, out) split along its rows (W's columns), see the module doc."""

    split_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: ProcessGroup | None = None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        seq_dim: int = 1,
        transposed: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str = "RowParallelLinear",
    ) -> None:
        super().__init__()
        tp = comm.get_world_size(group)
        if in_features % tp:
            fix = "the column layer before it must split the same features"
            raise _not_divisible(name, "in_features", in_features, tp, fix)
        self.packs, self.transposed = 1, transposed
        self._setup(group, in_features, out_features, bias, {"device": device, "dtype": dtype})
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def _place(self) -> None:
        super()._place()
        if self.sequence_parallel and self.bias is not None:
            sum_grad_over_tp(self.bias, self.group)  # added on a sequence shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, -1)
        y = F.linear(x, self._w())  # (.., in/n) @ (in/n, out): a partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.group, self.seq_dim)
        else:
            y = reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y
