"""Each tensor-parallel layer against the plain PyTorch layer built from the same full weights.

The table: layer x variant x TP size (2, 4) x vocabulary divisible or not (16, 13). Every rank
builds the full layer (nn.Linear / nn.Embedding / F.cross_entropy) and its own slice, runs the
same input, and compares: the output (or its slice), the gradient of the input (or of its
slice) and the gradient of each parameter, chunk by chunk against the full gradient's box.
Padded rows (vocabulary not divisible) must hold zeros and get zero gradient.

Tolerance: fp32, and the split changes only how sums are grouped (a dot product over in/n
features then an all-reduce; a softmax denominator summed per vocabulary slice), so results
differ by a few ulps of values up to about 8 (bias gradients sum 8 positions): measured max
9.5e-7 (a cross-entropy of about 4: 2 ulps), most diffs 2e-7. Bound 5e-6; a wrong slice, a
missing all-reduce or a gradient counted twice is off by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed

from shardwise import comm
from shardwise.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from shardwise.parallel.tensor.placement import get_placement
from shardwise.parallel.tensor.vocab import (
    VocabParallelCrossEntropyLoss,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

ATOL = 5e-6
B, T = 2, 4


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _box_of(full: torch.Tensor, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the slice of ``full.grad`` that ``param`` covers, ``param.grad`` without padding)."""
    box = get_placement(param).logical_box()
    local = param.grad[tuple(slice(0, b - a) for a, b in box)]
    return full.grad[tuple(slice(a, b) for a, b in box)], local


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:  # a rank holding only padding
        return 0.0
    return (a.float() - b.float()).abs().max().item()


def _param_diffs(full_module: torch.nn.Module, split: torch.nn.Module) -> dict[str, float]:
    out = {}
    for name, p in split.named_parameters():
        want, got = _box_of(getattr(full_module, name), p)
        out[f"grad {name}"] = _diff(got, want)
        pad = p.grad.numel() - got.numel()
        if pad:  # the padding rows: zero gradient, zero values
            out[f"pad {name}"] = max(p.grad.abs().sum().item() - got.abs().sum().item(), 0.0)
    return out


def _seq_chunk(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    n, r = comm.get_world_size(), comm.get_rank()
    return x.chunk(n, dim)[r]


def column_case(variant: str) -> dict[str, float]:
    gather, sp = "gather" in variant, "sp" in variant
    torch.manual_seed(0)
    full = torch.nn.Linear(12, 8)
    x = _rand(B, T, 12, seed=1).requires_grad_()
    w_out = _rand(B, T, 8, seed=2)
    y_ref = full(x)
    (y_ref * w_out).sum().backward()
    layer = ColumnParallelLinear.from_linear(full, None, gather_output=gather, sequence_parallel=sp)
    x_in = (_seq_chunk(x) if sp else x).detach().requires_grad_()
    y = layer(x_in)
    n, r = comm.get_world_size(), comm.get_rank()
    want = y_ref if gather else y_ref.chunk(n, -1)[r]
    (y * (w_out if gather else w_out.chunk(n, -1)[r])).sum().backward()
    x_want = _seq_chunk(x.grad) if sp else x.grad
    return {"output": _diff(y, want), "input grad": _diff(x_in.grad, x_want)} | _param_diffs(
        full, layer
    )


def row_case(variant: str) -> dict[str, float]:
    sp = "sp" in variant
    torch.manual_seed(0)
    full = torch.nn.Linear(8, 12)
    x = _rand(B, T, 8, seed=1).requires_grad_()
    w_out = _rand(B, T, 12, seed=2)
    y_ref = full(x)
    (y_ref * w_out).sum().backward()
    n, r = comm.get_world_size(), comm.get_rank()
    layer = RowParallelLinear.from_linear(full, None, sequence_parallel=sp)
    x_in = x.detach().chunk(n, -1)[r].requires_grad_()
    y = layer(x_in)
    (y * (_seq_chunk(w_out) if sp else w_out)).sum().backward()
    want = _seq_chunk(y_ref) if sp else y_ref
    out = {"output": _diff(y, want), "input grad": _diff(x_in.grad, x.grad.chunk(n, -1)[r])}
    return out | _param_diffs(full, layer)


def embedding_case(vocab: int) -> dict[str, float]:
    torch.manual_seed(0)
    full = torch.nn.Embedding(vocab, 6)
    ids = torch.arange(B * 2 * vocab).remainder(vocab).view(B, -1)  # every id, twice per row
    w_out = _rand(*ids.shape, 6, seed=2)
    y_ref = full(ids)
    (y_ref * w_out).sum().backward()
    layer = VocabParallelEmbedding.from_embedding(full, None)
    y = layer(ids)
    (y * w_out).sum().backward()
    return {"output": _diff(y, y_ref)} | _param_diffs(full, layer)


def _local_logits(full: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary slice of (N, V), padded with -inf as a vocab head pads it."""
    n, r = comm.get_world_size(), comm.get_rank()
    vl = -(-full.size(-1) // n)
    padded = F.pad(full.detach(), (0, vl * n - full.size(-1)), value=float("-inf"))
    return padded[:, r * vl : (r + 1) * vl].clone()


def cross_entropy_case(vocab: int, reduction: str) -> dict[str, float]:
    r = comm.get_rank()
    logits = (3 * _rand(10, vocab, seed=1)).requires_grad_()
    target = torch.arange(10).remainder(vocab)
    target[3] = -100  # an ignored position
    ref = F.cross_entropy(logits, target, reduction=reduction)
    ref.backward(torch.ones_like(ref))
    local = _local_logits(logits).requires_grad_()
    if reduction == "mean":
        loss = VocabParallelCrossEntropyLoss(None)(local, target)
    else:
        loss = vocab_parallel_cross_entropy(local, target, None, reduction=reduction)
    loss.backward(torch.ones_like(loss))
    vl, real = local.size(1), max(0, min(local.size(1), vocab - r * local.size(1)))
    want = logits.grad[:, r * vl : r * vl + real]
    pad = local.grad[:, real:].abs().sum().item()
    return {"loss": _diff(loss, ref), "logits grad": _diff(local.grad[:, :real], want), "pad": pad}


def vocab_head_case(vocab: int) -> dict[str, float]:
    """An LM head split by vocabulary (padded, -inf logits) + the vocab-parallel loss equal
    F.cross_entropy of the full head; with gather_output the logits equal the full ones."""
    torch.manual_seed(0)
    full = torch.nn.Linear(6, vocab, bias=True)
    x = _rand(B, T, 6, seed=1).requires_grad_()
    target = torch.arange(B * T).remainder(vocab).view(B, T)
    ref = F.cross_entropy(full(x).flatten(0, 1), target.flatten())
    ref.backward()
    head = ColumnParallelLinear.from_linear(full, None, pad_vocab=True)
    x_in = x.detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(head(x_in), target, None)
    loss.backward()
    rep = ColumnParallelLinear.from_linear(full, None, pad_vocab=True, gather_output=True)
    out = {"loss": _diff(loss, ref), "input grad": _diff(x_in.grad, x.grad)}
    out["gathered logits"] = _diff(rep(x), full(x))
    return out | _param_diffs(full, head)


CASES = {
    "column": (column_case, "plain"),
    "column gather_output": (column_case, "gather"),
    "column sequence_parallel": (column_case, "sp"),
    "column gather+sp": (column_case, "gather sp"),
    "row": (row_case, "plain"),
    "row sequence_parallel": (row_case, "sp"),
    "embedding V16": (embedding_case, 16),
    "embedding V13": (embedding_case, 13),
    "cross_entropy V16 mean": (cross_entropy_case, 16, "mean"),
    "cross_entropy V13 mean": (cross_entropy_case, 13, "mean"),
    "cross_entropy V13 sum": (cross_entropy_case, 13, "sum"),
    "cross_entropy V5 none": (cross_entropy_case, 5, "none"),  # tp=4: rank 3 all padding
    "vocab head V16": (vocab_head_case, 16),
    "vocab head V13": (vocab_head_case, 13),
}


def run_cases(names: list[str]) -> dict[str, dict[str, float]]:
    return {name: CASES[name][0](*CASES[name][1:]) for name in names}


@pytest.mark.parametrize("tp", [2, 4])
def test_each_layer_matches_the_full_layer(tp):
    results = run_distributed(run_cases, tp, list(CASES))
    for rank, per_case in enumerate(results):
        for case, diffs in per_case.items():
            for what, d in diffs.items():
                assert d <= ATOL, f"{case} tp={tp} rank {rank}: {what} differs by {d:.2e}"


def test_not_divisible_names_the_module():
    lin = torch.nn.Linear(8, 6)
    with pytest.raises(ValueError, match=r"blocks.0.q: out_features 6 .* size 4"):
        ColumnParallelLinear(8, 6, group=_FakeGroup(4), name="blocks.0.q")
    with pytest.raises(ValueError, match=r"proj: in_features 6 .* size 4"):
        RowParallelLinear(6, 8, group=_FakeGroup(4), name="proj")
    assert lin.out_features == 6  # the full layer is untouched by a failed split


class _FakeGroup:
    """Stands for a group of ``n`` ranks in single-process checks of the size validation."""

    def __init__(self, n: int) -> None:
        self.n = n


@pytest.fixture(autouse=True)
def _fake_sizes(monkeypatch):
    real_size, real_rank = comm.get_world_size, comm.get_rank
    monkeypatch.setattr(
        comm, "get_world_size", lambda g=None: g.n if isinstance(g, _FakeGroup) else real_size(g)
    )
    monkeypatch.setattr(
        comm, "get_rank", lambda g=None: 0 if isinstance(g, _FakeGroup) else real_rank(g)
    )
