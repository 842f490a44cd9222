"""Small deterministic models and data for the equivalence tests."""

import torch
from torch import nn


class TinyMLP(nn.Module):
    """Two hidden layers; no parameter whose exact gradient is zero (see design notes)."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_model(seed: int = 0, **kw) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP(**kw)


def make_data(n: int, d_in: int = 16, d_out: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = torch.randn(n, d_out, generator=g)
    return x, y


def rank_slice(step: int, micro: int, rank: int, mb: int, dp: int, gas: int) -> slice:
    """Rows of the global data used by ``rank`` at micro-step ``micro`` of global ``step``:
    global batch k = rows [k*B, (k+1)*B), micro-step-major, then rank (B = mb*dp*gas)."""
    start = step * mb * dp * gas + micro * mb * dp + rank * mb
    return slice(start, start + mb)
