"""The backward split into B (input gradient) and W (weight gradient), without processes.

split_linear.py computes, for every linear, dX = dY W in B and dW = dY^T X, db = sum dY in
W, with the products torch's own linear backward uses on operands of the same layout. So the
sum of B and W must give the fused backward's gradients bit for bit (fp32, one thread): the
tolerance is zero, and every comparison below is ``torch.equal``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.parallel.pipeline.instructions import Op
from shardwise.parallel.pipeline.schedule import one_f_one_b, simulate
from shardwise.parallel.pipeline.split_linear import LinearSplitter, deferring, weight_backward
from shardwise.parallel.pipeline.zero_bubble import fuse_backward, split_backward


class Transposed(nn.Module):
    """A linear whose weight is stored (in, out), as GPT-2's Conv1D and some TP layers."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_in, d_out) * 0.1)

    def forward(self, x):
        return F.linear(x, self.w.t())


class Block(nn.Module):
    def __init__(self, width, bias):
        super().__init__()
        self.calls = 0
        self.fc = nn.Linear(width, 4 * width, bias=bias)
        self.proj = nn.Linear(4 * width, width, bias=bias)
        self.norm = nn.LayerNorm(width)  # not a linear: its gradients come in B

    def forward(self, x):
        self.calls += 1
        return x + self.proj(torch.tanh(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width, bias, ckpt):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(width, bias) for _ in range(2)])
        self.head = Transposed(width, 5)
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return self.head(x)


SHAPES = [(6, 24), (3, 5, 24), (2, 64, 96)]  # 2-D rows, 3-D (batch, time, width), bigger
CASES = [(s, bias, ckpt) for s in SHAPES for bias in (True, False) for ckpt in (False, True)]


@pytest.mark.parametrize("shape,bias,ckpt", CASES, ids=[f"{s}-b{b}-c{c}" for s, b, c in CASES])
def test_b_plus_w_is_the_fused_backward_bit_for_bit(shape, bias, ckpt):
    fused, split = Net(shape[-1], bias, ckpt), Net(shape[-1], bias, ckpt)
    splitter = LinearSplitter(split)
    torch.manual_seed(1)
    for mb in range(2):  # two micro-batches: W adds into gradients that already exist
        x = torch.randn(*shape, requires_grad=True)
        dy = torch.randn(*shape[:-1], 5)
        fused(x).backward(dy)
        want_dx, x.grad = x.grad, None
        splitter.active = True
        out = split(x)
        sink = []
        with deferring(sink):
            out.backward(dy)  # B
        splitter.active = False
        assert torch.equal(x.grad, want_dx), f"{shape}: dX"
        linears = 5  # fc, proj of two blocks and the head
        assert len(sink) == linears
        deferred = {id(d.weight) for d in sink} | {id(d.bias) for d in sink}
        for p in split.parameters():
            if mb == 0 and p.grad is not None:  # after the first B only the norms have theirs
                assert id(p) not in deferred
        weight_backward(sink)  # W
    for (name, a), b in zip(fused.named_parameters(), split.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), f"{shape} bias={bias} ckpt={ckpt}: {name}"


def test_checkpointed_layers_recompute_once_in_b_and_not_in_w():
    net = Net(16, True, ckpt=True)
    splitter = LinearSplitter(net)
    splitter.active = True
    out = net(torch.randn(4, 16, requires_grad=True))
    assert [b.calls for b in net.blocks] == [1, 1]
    sink = []
    with deferring(sink):
        out.sum().backward()
    splitter.active = False
    assert [b.calls for b in net.blocks] == [2, 2]  # the recompute, in B
    weight_backward(sink)
    assert [b.calls for b in net.blocks] == [2, 2]  # W used what the recompute kept


def test_without_a_sink_the_split_linear_is_the_fused_backward():
    fused, split = Net(16, True, False), Net(16, True, False)
    splitter = LinearSplitter(split)
    x = torch.randn(3, 16)
    fused(x).sum().backward()
    splitter.active = True
    split(x).sum().backward()  # no deferring(): every gradient at once
    for a, b in zip(fused.parameters(), split.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_accumulation_hooks_fire_in_w():
    net = Net(8, True, False)
    splitter = LinearSplitter(net)
    fired = []
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    splitter.active = True
    out = net(torch.randn(2, 8))
    sink = []
    with deferring(sink):
        out.sum().backward()
    in_b = set(fired)
    weight_backward(sink)
    assert in_b | set(fired) == {id(p) for p in net.parameters()}
    assert in_b == {id(p) for b in net.blocks for p in b.norm.parameters()}


def test_split_and_fuse_are_inverse_and_split_1f1b_runs():
    for p, m in [(2, 3), (4, 8)]:
        progs = [one_f_one_b(p, s, m) for s in range(p)]
        split = [split_backward(prog) for prog in progs]
        assert [fuse_backward(prog) for prog in split] == progs
        for prog in split:
            ops = [ins.op for ins in prog]
            assert ops.count(Op.BACKWARD_INPUT) == ops.count(Op.BACKWARD_WEIGHT) == m
        # W after the gradient is sent: the previous stage gets it W earlier.
        assert simulate(split, t_backward=2.0, t_weight=1.0) < simulate(progs)
    assert repr(split_backward(one_f_one_b(2, 1, 1))) == "[L0, rA0, F0, I0, sG0, W0, RG, RT, S]"
