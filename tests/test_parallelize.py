"""parallelize(model, plan, group): the example GPT split by its own plan computes like one process.

The table: TP size x sequence parallelism x tied embedding/head x biases. Every rank builds the
GPT from one seed, parallelizes a copy with ``GPT.tp_plan`` and compares with the unsplit
model on the same batch: the loss, every parameter's gradient (each split parameter against
its box of the full gradient; padding rows of the vocabulary must get none), then the losses
of a few SGD steps and the final weights.

Tolerance (fp32): TP only regroups sums (matmul inner sums split in n partial sums, softmax
denominators summed per vocabulary slice), so each value differs by rounding. Measured over
the table: losses within 4.8e-7 (2 ulps of a loss of 2.6), gradients 1.8e-7, weights after 3
SGD steps 6e-8. Bound 2e-6, four times the largest; a missing all-reduce or a norm gradient
not summed over sequence shards moves gradients by 1e-3 or more.

Then: the random streams (replicated dropout equal across TP ranks, split dropout not), the
communication of one transformer block (Megatron: 2 all-reduces forward, 2 backward), and the
errors a bad plan gives.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_distributed
from models import GPT_SIZES, example_module, make_gpt, make_tokens
from torch import nn

from shardwise import comm
from shardwise.parallel.tensor import random as tp_random
from shardwise.parallel.tensor.parallelize import match_plan, parallelize, resolve_plan
from shardwise.parallel.tensor.placement import get_placement

ATOL = 2e-6
# make_gpt's sizes: V = 13 is divisible by neither 2 nor 4, so the vocabulary padding is exercised
B, T, V = 2, GPT_SIZES["block_size"], GPT_SIZES["vocab_size"]


def _gpt():
    return example_module("gpt", "model")


def batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return make_tokens(B, V, T, seed)


def _grad_diffs(full: nn.Module, split: nn.Module) -> dict[str, float]:
    """Per parameter: |split grad - its box of the full grad|, plus any gradient on padding."""
    want = dict(full.named_parameters())
    out = {}
    for name, p in split.named_parameters():
        box = get_placement(p).logical_box()
        got = p.grad[tuple(slice(0, b - a) for a, b in box)]
        ref = want[name].grad[tuple(slice(a, b) for a, b in box)]
        out[name] = (got - ref).abs().max().item() if got.numel() else 0.0
        out[name + " (padding)"] = p.grad.abs().sum().item() - got.abs().sum().item()
    return out


def _weight_diffs(full: nn.Module, split: nn.Module) -> dict[str, float]:
    want = dict(full.named_parameters())
    out = {}
    for name, p in split.named_parameters():
        box = get_placement(p).logical_box()
        got = p.detach()[tuple(slice(0, b - a) for a, b in box)]
        ref = want[name].detach()[tuple(slice(a, b) for a, b in box)]
        out[name] = (got - ref).abs().max().item() if got.numel() else 0.0
    return out


def gpt_case(sp: bool, **cfg) -> dict:
    tp_random.model_parallel_seed(0, comm.get_rank())
    full = make_gpt(**cfg)
    split = parallelize(copy.deepcopy(full), full.tp_plan, None, sequence_parallel=sp)
    x, y = batch()
    loss_full, loss_split = full(x, y), split(x, y)
    loss_full.backward()
    loss_split.backward()
    result = {"loss": abs(loss_full.item() - loss_split.item()), "grads": _grad_diffs(full, split)}
    steps = []
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (full, split)]
    for k in range(3):
        for opt in opts:
            opt.step()
            opt.zero_grad()
        x, y = batch(seed=10 + k)
        losses = [m(x, y) for m in (full, split)]
        for loss in losses:
            loss.backward()
        steps.append(abs(losses[0].item() - losses[1].item()))
    result["step losses"] = steps
    result["weights"] = _weight_diffs(full, split)
    result["tied"] = split.head.weight is split.tok_emb.weight
    return result


LAYOUTS = [
    # name, TP size, sequence parallel, GPT config
    ("TP2", 2, False, {}),
    ("TP2 SP", 2, True, {}),
    ("TP2 SP bias", 2, True, {"bias": True}),
    ("TP4", 4, False, {"bias": True}),
    ("TP4 SP tied", 4, True, {"tie_weights": True}),
    ("TP2 tied bias", 2, False, {"tie_weights": True, "bias": True}),
]


@pytest.mark.parametrize("name,tp,sp,cfg", LAYOUTS, ids=[row[0] for row in LAYOUTS])
def test_parallelized_gpt_matches_one_process(name, tp, sp, cfg):
    results = run_distributed(gpt_case, tp, sp, **cfg)
    for rank, got in enumerate(results):
        tag = f"layout {name} rank {rank}"
        assert got["loss"] <= ATOL, f"{tag}: loss differs by {got['loss']:.2e}"
        for param, d in got["grads"].items():
            assert d <= ATOL, f"{tag}: gradient of {param} differs by {d:.2e}"
        assert max(got["step losses"]) <= ATOL, f"{tag}: step losses {got['step losses']}"
        for param, d in got["weights"].items():
            assert d <= ATOL, f"{tag}: {param} after 3 SGD steps differs by {d:.2e}"
        assert got["tied"] == cfg.get("tie_weights", False), f"{tag}: weight tying lost"


# ----------------------------------------------------------------------------- random streams


def _record_mask(masks: dict, name: str):
    def hook(module, args, out):
        masks[name] = out == 0

    return hook


def dropout_case() -> dict:
    """Masks of the GPT's dropouts on each rank, with SP off and on."""
    out = {}
    for sp in (False, True):
        tp_random.model_parallel_seed(0, comm.get_rank())
        model = parallelize(make_gpt(dropout=0.5), _gpt().GPT.tp_plan, None, sequence_parallel=sp)
        masks = {}
        for name in ("drop", "blocks.0.attn.resid_drop", "blocks.1.mlp.drop"):
            model.get_submodule(name).register_forward_hook(_record_mask(masks, name))
        x, y = batch()
        loss = model(x, y)
        out[sp] = {"masks": masks, "loss": loss.item(), "after": torch.rand(3)}
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_dropout_masks_follow_the_layout(tp):
    """Replicated activations (SP off) draw one mask on every TP rank; sequence shards (SP on)
    draw independent ones. Either way every rank computes the same loss, and the split
    regions leave the default stream as every other rank has it."""
    results = run_distributed(dropout_case, tp)
    for sp in (False, True):
        first = results[0][sp]
        for rank, per_sp in enumerate(results[1:], 1):
            got, tag = per_sp[sp], f"tp={tp} sp={sp} rank {rank}"
            assert got["loss"] == first["loss"], f"{tag}: TP ranks disagree on the loss"
            assert torch.equal(got["after"], first["after"]), f"{tag}: default stream diverged"
            for name, mask in got["masks"].items():
                same = torch.equal(mask, first["masks"][name])
                assert same != sp, f"{tag}: {name} mask {'equal' if same else 'differs'}"
        for name, mask in first["masks"].items():  # dropout p = 0.5 in distribution
            assert 0.4 < mask.float().mean() < 0.6, (
                f"tp={tp} sp={sp}: {name} drops {mask.float().mean():.2f}"
            )


def split_dropout_case() -> dict:
    tp_random.model_parallel_seed(0, comm.get_rank())
    model = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5))
    parallelize(model, {"1": "split_dropout"}, None)
    ones = torch.ones(4, 64)
    replicated = model[0](ones) == 0
    return {"replicated": replicated, "split": model(ones) == 0, "after": torch.rand(3)}


def test_split_dropout_uses_the_rank_stream():
    r0, r1 = run_distributed(split_dropout_case, 2)
    assert torch.equal(r0["replicated"], r1["replicated"]), "default stream differs across TP"
    assert not torch.equal(r0["split"], r1["split"]), "split_dropout drew the same mask"
    assert torch.equal(r0["after"], r1["after"]), "split_dropout advanced the default stream"


def test_rng_tracker_fork_and_states():
    tracker = tp_random.RNGStatesTracker()
    tracker.add("a", 7)
    torch.manual_seed(1)
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(4)
    after = torch.rand(4)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(4)), "fork moved the default stream"
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(7)))
    tracker.set_states(saved)  # a recompute replays the same draws
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), first)
    assert tracker in tp_random.all_trackers()
    with pytest.raises(KeyError, match="model_parallel_seed"):
        with tracker.fork("missing"):
            pass
    with pytest.raises(ValueError, match="seed 7"):
        tracker.add("b", 7)


# ----------------------------------------------------------------------------- communication


def block_comm_case(sp: bool) -> dict:
    """comm.stats() of one GPT block's forward and backward (SP: behind an entry dropout)."""
    tp_random.model_parallel_seed(0, comm.get_rank())
    m = _gpt()
    block = m.Block(m.GPTConfig(n_embd=16, n_head=4, block_size=T))
    plan = {k.removeprefix("blocks.*."): v for k, v in m.GPT.tp_plan.items() if "blocks" in k}
    model = nn.Sequential(nn.Dropout(0.0), block)
    plan = {f"1.{k}": v for k, v in plan.items()} | {"0": "sequence_parallel"}
    parallelize(model, plan, None, sequence_parallel=sp)
    x = torch.randn(B, T, 16, requires_grad=True)
    comm.reset_stats()
    y = model(x)
    forward = comm.stats()
    comm.reset_stats()
    y.sum().backward()
    return {"forward": forward, "backward": comm.stats()}


def _calls(stats: dict) -> dict[str, int]:
    return {op: v["calls"] for op, v in stats.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_one_block_communicates_like_megatron(tp):
    """SP off: 2 all-reduces of the (B, T, C) activations forward (attention, MLP), 2 backward
    (q, k, v share one). SP on: each becomes an all-gather + a reduce-scatter; backward adds
    the entry's all-gather and one all-reduce per norm weight (sequence shards)."""
    off, on = (run_distributed(block_comm_case, tp, sp)[0] for sp in (False, True))
    act = B * T * 16 * 4  # bytes of one fp32 (B, T, C) activation
    assert _calls(off["forward"]) == {"all_reduce": 2}, off["forward"]
    assert _calls(off["backward"]) == {"all_reduce": 2}, off["backward"]
    for phase in ("forward", "backward"):
        s = off[phase]["all_reduce"]
        assert s["bytes"] == 2 * act, (phase, s)
        assert s["sent_bytes"] == round(2 * 2 * (tp - 1) / tp * act), (phase, s)  # ring
    assert _calls(on["forward"]) == {"all_gather": 2, "reduce_scatter": 2}, on["forward"]
    assert _calls(on["backward"]) == {"reduce_scatter": 2, "all_gather": 3, "all_reduce": 2}, on[
        "backward"
    ]


# ----------------------------------------------------------------------------- bad plans


class _FakeGroup:
    """A group of ``n`` ranks for the checks parallelize makes before any communication."""

    def __init__(self, n: int) -> None:
        self.n = n


@pytest.fixture
def fake_tp(monkeypatch):
    size, rank = comm.get_world_size, comm.get_rank
    monkeypatch.setattr(comm, "get_world_size", lambda g=None: getattr(g, "n", None) or size(g))
    monkeypatch.setattr(comm, "get_rank", lambda g=None: 0 if hasattr(g, "n") else rank(g))
    return _FakeGroup


BAD_PLANS = [
    ({"blocks.*.attn.q": "colwize"}, "unknown style 'colwize'; did you mean 'colwise'"),
    (
        {"blocks.*.attn.query": "colwise"},
        r"\['blocks.\*.attn.query'\] \(tensor_parallel.plan.* match no module",
    ),
    ({"blocks.*.ln_1": "colwise"}, "matched 'blocks.0.ln_1', a LayerNorm, .* not a linear layer"),
    ({"blocks.0.attn.q": "colwise", "blocks.*.attn.q": "rowwise"}, "keep one"),
    ({}, "plan is empty"),
]


@pytest.mark.parametrize("plan,error", BAD_PLANS, ids=[e[:20] for _, e in BAD_PLANS])
def test_bad_plan_is_refused_by_name(plan, error):
    with pytest.raises(ValueError, match=error):
        parallelize(make_gpt(), plan, None)


def test_sizes_are_checked_before_anything_changes(fake_tp):
    model = make_gpt(n_head=2)
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"blocks.0.attn: 2 attention heads .* size 4"):
        parallelize(model, model.tp_plan, fake_tp(4))
    with pytest.raises(ValueError, match=r"blocks.0.mlp.fc: out_features 64 .* size 3"):
        parallelize(model, {"blocks.*.mlp.fc": "colwise"}, fake_tp(3))
    with pytest.raises(ValueError, match="needs 'sequence_parallel' entries"):
        parallelize(model, {"head": "vocab"}, fake_tp(2), sequence_parallel=True)
    assert [type(m) for m in model.modules()] == before, "a refused plan changed the model"


def test_a_tied_parameter_must_be_split_on_both_sides():
    with pytest.raises(RuntimeError, match="'head.weight' is tied"):
        run_distributed(_tied_half_case, 2)


def _tied_half_case() -> None:
    tp_random.model_parallel_seed(0, comm.get_rank())
    parallelize(make_gpt(tie_weights=True), {"tok_emb": "vocab"}, None)


def test_resolve_plan_order():
    model = make_gpt()
    assert resolve_plan(model, {"head": "vocab"}) == {"head": "vocab"}  # the config wins
    assert resolve_plan(model) == model.tp_plan
    hf = nn.Module()
    hf.model = nn.Module()
    hf.base_model_prefix = "model"
    hf.config = type("Cfg", (), {"base_model_tp_plan": {"layers.*.q_proj": "colwise"}})()
    assert resolve_plan(hf) == {"model.layers.*.q_proj": "colwise"}
    with pytest.raises(ValueError, match=r'"tensor_parallel": \{"size": N, "plan"'):
        resolve_plan(nn.Linear(2, 2))
    assert list(match_plan(model, model.tp_plan))[:2] == ["tok_emb", "drop"]  # module order
