"""The zero-bubble schedules train like one process: 35 steps, fp32, PP2 and PP4, with and
without activation checkpointing and a tied embedding.

Each test runs one schedule at one pipeline size over three models in one world: an MLP
(plain), the same MLP with every layer checkpointed, and a language model whose input
embedding is its output projection (in the V placement both ends sit on stage 0, where the one
module gets both uses' gradients; in a loop they are on the first and the last stage and are
summed across them). The reference is tests/pipe_models.py's plain PyTorch loop on the same
global batches from the same weights, SGD with momentum, clipping engaged.

Tolerance: fp32, 1e-5 relative on every step's loss and 1e-5 absolute on every parameter after
35 steps (issue 29). The pipeline changes no product (B + W is the fused backward bit for bit,
tests/test_pipe_split_backward.py), only the order of sums: a batch's gradient accumulated over
m micro-batches instead of one matmul. Measured: in the final report of issue 29 and
docs/pipeline.md.

PP4 in a V has 8 virtual stages, more than the pipe_models' MLP and LM have trainable layers:
"deep" (9 linears) and "deep-lm" (7 linears between a tied embedding) serve there, registered
in pipe_models.MODELS below so that its reference_run and data serve them too.
"""

import pipe_models
import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from one_process import reference_run
from pipe_models import MODELS, D, lm_loss, logits, micro_batches, pipeline_module, setup
from torch import nn

import shardwise
from shardwise.pipe import LayerSpec, TiedLayerSpec

STEPS, MB, LR, CLIP = 35, 2, 0.1, 0.05
DEPTH = 9


def deep_layers():
    return [x for i in range(DEPTH) for x in (LayerSpec(nn.Linear, 16, 16), nn.Tanh())] + [
        LayerSpec(nn.Linear, 16, 4)
    ]


def deep_reference():
    return nn.Sequential(
        *[x for _ in range(DEPTH) for x in (nn.Linear(16, 16), nn.Tanh())], nn.Linear(16, 4)
    )


def deep_lm_layers():
    middle = [x for _ in range(7) for x in (LayerSpec(nn.Linear, D, D), nn.Tanh())]
    return [
        TiedLayerSpec("embed", nn.Embedding, 11, D),
        *middle,
        TiedLayerSpec("embed", nn.Embedding, 11, D, forward_fn=logits),
    ]


class DeepLMReference(nn.Module):
    def __init__(self):
        super().__init__()
        self.tied_modules = nn.ModuleDict({"embed": nn.Embedding(11, D)})
        for i in range(1, 15, 2):
            self.add_module(str(i), nn.Linear(D, D))

    def forward(self, tokens):
        emb = self.tied_modules["embed"]
        h = emb(tokens)
        for i in range(1, 15, 2):
            h = torch.tanh(getattr(self, str(i))(h))
        return logits(emb, h)


MODELS.setdefault("deep", (deep_layers, deep_reference, F.mse_loss))
MODELS.setdefault("deep-lm", (deep_lm_layers, DeepLMReference, lm_loss))
_make_batches = pipe_models.make_batches  # the deep models read the data of their shallow kin


def _batches(model, n):
    return _make_batches({"deep": "mlp", "deep-lm": "lm"}.get(model, model), n)


pipe_models.make_batches = _batches


def _variants(schedule, pp):
    """(model, module options) of the three runs: plain, checkpointed, tied."""
    v_shape = schedule in ("zbv", "dualpipev")
    mlp, lm = ("deep", "deep-lm") if v_shape and pp == 4 else ("mlp", "lm")
    method = {"partition_method": "type:linear"} if v_shape and pp == 4 else {}
    return [
        (mlp, method),
        (mlp, {**method, "activation_checkpoint_interval": 1}),
        (lm, {}),
    ]


def _train(schedule, pp, gas):
    chunks = 2 if schedule in ("zbv", "dualpipev") else 1
    out = []
    for model, options in _variants(schedule, pp):
        if chunks == 2:
            options = {**options, "chunks": 2, "placement": "v"}
        config = {
            "train_micro_batch_size_per_gpu": MB,
            "gradient_accumulation_steps": gas,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "pipeline": {"schedule": schedule, "chunks": chunks},
        }
        engine, *_ = shardwise.initialize(
            model=pipeline_module(model, pp, **options), config=config
        )
        data = micro_batches(model, engine, MB, gas, STEPS)
        reads = engine.is_first_stage() or engine.is_last_stage()
        losses = [engine.train_batch(data if reads else None).item() for _ in range(STEPS)]
        params = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
        out.append((losses, params))
    return out


ROWS = [  # (schedule, pp, micro-batches)
    ("zb-h1", 2, 4),
    ("zb-h1", 4, 6),
    ("zbv", 2, 4),
    ("zbv", 4, 8),
    ("dualpipev", 2, 4),
    ("dualpipev", 4, 8),
]


@pytest.mark.parametrize("schedule,pp,gas", ROWS, ids=[f"{s}-pp{p}-m{m}" for s, p, m in ROWS])
def test_zero_bubble_schedule_trains_like_one_process(schedule, pp, gas):
    results = run_distributed(_train, pp, schedule, pp, gas)
    for k, (model, options) in enumerate(_variants(schedule, pp)):
        want = reference_run(setup(model, 1, gas, MB, STEPS, LR, CLIP), STEPS)
        name = f"{schedule} pp{pp} m{gas} {model} {options or 'plain'}"
        worst_loss = worst_param = 0.0
        for rank, runs in enumerate(results):
            losses, params = runs[k]
            rel = [abs(a - b) / abs(b) for a, b in zip(losses, want["losses"], strict=True)]
            worst_loss = max(worst_loss, *rel)
            assert params.keys() == want["params"].keys(), f"{name} rank {rank}"
            for key, w in want["params"].items():
                worst_param = max(worst_param, (params[key] - w).abs().max().item())
        print(f"{name}: losses within {worst_loss:.1e} relative, parameters {worst_param:.1e}")
        assert worst_loss <= 1e-5 and worst_param <= 1e-5, name
