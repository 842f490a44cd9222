"""Small deterministic models and data for the equivalence tests, and the examples' modules:
the example GPT (``make_gpt``, ``make_tokens``) is built here for every test that trains it."""

import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

import shardwise

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example_module(example: str, name: str):
    """``examples/<example>/<name>.py`` as a module, loaded once under a unique name (several
    examples have a model.py / data.py; dataclasses look their module up in sys.modules)."""
    key = f"example_{example}_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / example / f"{name}.py")
        sys.modules[key] = mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules[key]


# The GPT of tensor-parallel tests: vocabulary 13, divisible by neither 2 nor 4, so tensor
# parallelism pads the vocabulary; other tests give their own sizes (any GPTConfig field).
GPT_SIZES = {"vocab_size": 13, "block_size": 8, "n_layer": 2, "n_head": 4, "n_embd": 16}


class _Bidirectional(nn.Module):
    """The GPT's attention without the causal mask (an encoder's)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return shardwise.attention(q, k, v, is_causal=False)


def make_gpt(causal: bool = True, seed: int | None = 0, **config) -> nn.Module:
    """examples/gpt's GPT built under ``seed`` (None: the caller has seeded torch): GPT_SIZES
    and GPTConfig's defaults unless ``config`` says otherwise (sizes, dropout, bias,
    tie_weights, ...); ``causal=False`` lets every token attend to every other."""
    m = example_module("gpt", "model")
    if seed is not None:
        torch.manual_seed(seed)
    model = m.GPT(m.GPTConfig(**{**GPT_SIZES, **config}))
    if not causal:
        for block in model.blocks:
            block.attn.attend = _Bidirectional()
    return model


def make_tokens(n: int, vocab: int = 13, seq: int = 8, seed: int = 3):
    """``n`` windows of ``seq`` tokens and their next tokens, each (n, seq)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


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


def _normal_init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.3)


class UnevenMLP(nn.Module):
    """Sizes no data-parallel degree divides: body.0 has 16*7+7 = 119 elements, head 7*4+4 = 32
    and ``scale`` 1 (fewer than N: some ranks' shard of it is all padding). The constructor sets
    its child's bias, calls ``self.apply(init)`` reaching a nested Linear (as Hugging Face models
    do), then re-initializes a nested bias in a loop over named_parameters (as nanoGPT does)."""

    def __init__(self, d_in: int = 16, hidden: int = 7, d_out: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, d_out)
        self.scale = nn.Parameter(torch.full((1,), 1.5))
        nn.init.constant_(self.head.bias, 0.1)  # a parent changing its child's parameter
        self.apply(_normal_init)
        for name, p in self.named_parameters():  # nanoGPT's loop: reaches a grandchild
            if name == "body.0.bias":
                nn.init.uniform_(p, -0.5, 0.5)

    def forward(self, x):
        return self.head(self.body(x)) * self.scale


class TiedMLP(nn.Module):
    """``mid`` runs twice per forward, and ``mid2`` shares its weight (tied parameters)."""

    def __init__(self, d_in: int = 16, hidden: int = 7, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.mid2 = nn.Linear(hidden, hidden)
        self.mid2.weight = self.mid.weight
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.mid(torch.tanh(self.mid(h))))
        return self.head(torch.tanh(self.mid2(h)))


def make_uneven(seed: int = 0, **kw) -> UnevenMLP:
    torch.manual_seed(seed)
    return UnevenMLP(**kw)


def make_tied(seed: int = 0, **kw) -> TiedMLP:
    torch.manual_seed(seed)
    return TiedMLP(**kw)


MODELS = {"tiny": make_model, "uneven": make_uneven, "tied": make_tied}
