"""Models, data and the one-process run (``setup``) for the pipeline tests.

Two models, each as a layer list for PipelineModule and as a plain PyTorch module built with
the same random draws in the same order (so the same weights) and the same state-dict names:

    mlp     9 layers (5 Linear + Tanh + a lambda): regression, MSE
    blocks  7 layers, 4 of them MLP blocks (fc, proj) for tensor parallelism: regression, MSE
    lm   a tiny language model whose input embedding is the output projection (TiedLayerSpec
         "embed" on the first and the last layer): cross-entropy over a vocabulary of 11
"""

from functools import partial

import torch
import torch.nn.functional as F
from models import make_data, rank_slice
from one_process import global_batches, precision
from torch import nn

from shardwise.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from shardwise.verify import VerifySetup

V, D, T = 11, 8, 6  # vocabulary, width, sequence length of the lm


def mlp_layers():
    return [
        LayerSpec(nn.Linear, 16, 32),
        nn.Tanh(),
        LayerSpec(nn.Linear, 32, 32),
        nn.Tanh(),
        LayerSpec(nn.Linear, 32, 32),
        lambda x: torch.tanh(x),
        LayerSpec(nn.Linear, 32, 32),
        nn.Tanh(),
        LayerSpec(nn.Linear, 32, 4),
    ]


def mlp_reference():
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


class MLPBlock(nn.Module):
    """x + proj(tanh(fc(x))): a Megatron MLP, fc split by column and proj by row under TP."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.proj(torch.tanh(self.fc(x)))


BLOCKS_PLAN = {"*.fc": "colwise", "*.proj": "rowwise"}


def blocks_layers():
    return [
        LayerSpec(nn.Linear, 16, 16),
        nn.Tanh(),
        *[LayerSpec(MLPBlock, 16) for _ in range(4)],
        LayerSpec(nn.Linear, 16, 4),
    ]


def blocks_reference():
    return nn.Sequential(
        nn.Linear(16, 16), nn.Tanh(), *[MLPBlock(16) for _ in range(4)], nn.Linear(16, 4)
    )


def logits(embedding, h):
    return h @ embedding.weight.t()  # (B, T, D) @ (D, V) -> (B, T, V)


def lm_loss(out, labels):
    return F.cross_entropy(out.reshape(-1, V), labels.reshape(-1))


def lm_layers():
    return [
        TiedLayerSpec("embed", nn.Embedding, V, D),
        LayerSpec(nn.Linear, D, D),
        nn.Tanh(),
        LayerSpec(nn.Linear, D, D),
        nn.Tanh(),
        LayerSpec(nn.Linear, D, D),
        TiedLayerSpec("embed", nn.Embedding, V, D, forward_fn=logits),
    ]


class LMReference(nn.Module):
    """The lm in plain PyTorch: one embedding used at both ends."""

    def __init__(self):
        super().__init__()
        self.tied_modules = nn.ModuleDict({"embed": nn.Embedding(V, D)})
        for i in (1, 3, 5):
            self.add_module(str(i), nn.Linear(D, D))

    def forward(self, tokens):
        emb = self.tied_modules["embed"]
        h = torch.tanh(getattr(self, "1")(emb(tokens)))
        h = getattr(self, "5")(torch.tanh(getattr(self, "3")(h)))
        return logits(emb, h)


MODELS = {
    "mlp": (mlp_layers, mlp_reference, F.mse_loss),
    "lm": (lm_layers, LMReference, lm_loss),
    "blocks": (blocks_layers, blocks_reference, F.mse_loss),
}


def make_batches(model: str, n: int):
    if model in ("mlp", "blocks"):
        return make_data(n)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (n, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def setup(
    model: str, dp: int, gas: int, mb: int, steps: int, lr: float, clip: float, bf16: bool = False
) -> VerifySetup:
    """The run a pipeline layout makes, for the one-process reference: ``model``'s plain
    PyTorch module (built with the pipeline's draws: same weights, same names) on the global
    batch of mb*dp*gas rows per step, SGD with momentum, clipping at ``clip``."""
    _, make_ref, loss_fn = MODELS[model]
    config = {
        "optimizer": {"type": "SGD", "params": {"lr": lr, "momentum": 0.9}},
        "gradient_clipping": clip,
        **precision("bf16" if bf16 else "fp32"),
    }
    batches = global_batches(partial(make_batches, model), mb * dp * gas, steps)
    return VerifySetup(make_ref, batches, config, loss_fn)


def micro_batches(model, engine, mb, gas, steps):
    """This rank's micro-batches, in order: micro-step-major then data rank, as the reference
    cuts its global batch (tests/models.py rank_slice)."""
    dp = engine.dp_world_size
    x, y = make_batches(model, mb * dp * gas * steps)
    for k in range(steps):
        for j in range(gas):
            rows = rank_slice(k, j, engine.dp_rank, mb, dp, gas)
            yield x[rows], y[rows]


def pipeline_module(model, num_stages, **kwargs):
    layers, _, loss_fn = MODELS[model]
    torch.manual_seed(0)
    return PipelineModule(layers(), num_stages=num_stages, loss_fn=loss_fn, **kwargs)
