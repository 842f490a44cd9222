"""Mixture of experts (docs/moe.md): each gating rule against a plain reference written here,
and expert-parallel layouts against one process holding all experts (moe_models.py).

Tolerances: fp32 with SGD, the layouts change only where sums happen (an all-to-all moves
tokens exactly; the expert-data all-reduce adds the same per-rank gradients in another
order), so parameters agree within 2e-6 and losses within 1e-5 relative, the data-parallel
bounds (test_dp.py). A layout that averages experts over the wrong group is off by a factor
ep in the expert gradients: parameters move by ~1e-2 after 4 steps (measured).
"""

import math

import pytest
import torch
from harness import run_distributed
from moe_models import (
    EXPERTS,
    MB,
    STEPS,
    MoENet,
    _engine,
    checkpoint_run,
    engine_run,
    make_data,
    seed_experts,
    setup,
    tutorial_run,
)
from one_process import reference_run

import shardwise as deepspeed
from shardwise.launch.cli import make_parser, topo_command
from shardwise.parallel.moe.gating import top1gating, top2gating


def _top1_reference(logits, cap, rand):
    """Per token: argmax expert; per expert keep the ``cap`` tokens with the largest ``rand``
    (random token selection); slots numbered in token order among the kept."""
    gates = torch.softmax(logits, dim=1)
    s_count, e_count = gates.shape
    choice = gates.argmax(dim=1)
    kept = torch.zeros(s_count, dtype=torch.bool)
    for e in range(e_count):
        mine = [s for s in range(s_count) if choice[s] == e]
        best = sorted(mine, key=lambda s: -float(rand[s, e]))[:cap]
        kept[best] = True
    combine = torch.zeros(s_count, e_count, cap)
    fill = [0] * e_count
    for s in range(s_count):
        if kept[s]:
            e = int(choice[s])
            combine[s, e, fill[e]] = gates[s, e]
            fill[e] += 1
    me, ce = gates.mean(0), torch.bincount(choice, minlength=e_count).float() / s_count
    return e_count * float((me * ce).sum()), combine


def _top2_reference(logits, cap):
    """First choices take slots in token order, then second choices; weights renormalised
    over the kept choices of each token."""
    gates = torch.softmax(logits, dim=1)
    s_count, e_count = gates.shape
    first = gates.argmax(dim=1)
    second = logits.masked_fill(torch.nn.functional.one_hot(first, e_count).bool(), -1e30)
    second = second.argmax(dim=1)
    fill = [0] * e_count
    slot = {}
    for which, choice in ((0, first), (1, second)):
        for s in range(s_count):
            e = int(choice[s])
            if fill[e] < cap:
                slot[(s, which)] = (e, fill[e])
            fill[e] += 1
    combine = torch.zeros(s_count, e_count, cap)
    for s in range(s_count):
        kept = [slot[(s, w)] for w in (0, 1) if (s, w) in slot]
        total = sum(float(gates[s, e]) for e, _ in kept)
        for e, c in kept:
            combine[s, e, c] = gates[s, e] / max(total, torch.finfo(torch.float32).eps)
    me, ce = gates.mean(0), torch.bincount(first, minlength=e_count).float() / s_count
    return e_count * float((me * ce).sum()), combine


# (name, k, tokens, capacity_factor, min_capacity): both with and without dropping
GATING = [
    ("top1-drop", 1, 40, 0.5, 2),
    ("top1-nodrop", 1, 40, 4.0, 2),
    ("top1-min-capacity-drop", 1, 24, 0.1, 4),
    ("top2-drop", 2, 40, 0.5, 2),
    ("top2-nodrop", 2, 40, 4.0, 2),
]


@pytest.mark.parametrize("name,k,tokens,factor,min_cap", GATING, ids=[g[0] for g in GATING])
def test_gating_matches_the_plain_reference(name, k, tokens, factor, min_cap):
    logits = torch.randn(tokens, EXPERTS, generator=torch.Generator().manual_seed(3)) * 2
    cap = max(math.ceil(tokens / EXPERTS * factor * k), min_cap)
    if k == 1:
        torch.manual_seed(5)
        l_aux, combine, mask, counts = top1gating(logits, factor, min_cap)
        torch.manual_seed(5)
        rand = torch.rand(tokens, EXPERTS)
        want_aux, want = _top1_reference(logits, cap, rand)
    else:
        l_aux, combine, mask, counts = top2gating(logits, factor, min_cap, True, None, False)
        want_aux, want = _top2_reference(logits, cap)
    assert combine.shape == (tokens, EXPERTS, cap), f"{name}: capacity {combine.shape}"
    assert torch.allclose(combine, want, atol=1e-6), f"{name}: combine weights differ"
    assert torch.equal(mask, combine.bool()), name
    assert float(l_aux) == pytest.approx(want_aux, rel=1e-6), f"{name}: l_aux"
    routed = int(counts.sum())
    assert routed == tokens * k, f"{name}: exp_counts count tokens before dropping"
    dropped = routed - int(mask.sum())
    assert (dropped > 0) == ("nodrop" not in name), f"{name}: {dropped} dropped"


def test_deepspeed_names_and_utils():
    """``import shardwise as deepspeed`` then DeepSpeed's MoE, is_moe_param and the split."""
    layer = deepspeed.moe.layer.MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=2)
    out, l_aux, counts = layer(torch.randn(2, 5, 8))
    assert out.shape == (2, 5, 8) and l_aux.dim() == 0 and counts.shape == (4,)
    experts = {id(p) for p in layer.deepspeed_moe.experts.parameters()}
    for p in layer.parameters():
        assert deepspeed.moe.utils.is_moe_param(p) == (id(p) in experts)
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(layer.parameters()), "lr": 0.1}
    )
    assert [g.get("name") for g in groups] == [None, "ep_size_1"], groups
    assert len(groups[1]["params"]) == len(experts) and groups[1]["lr"] == 0.1
    with pytest.raises(ValueError, match="ep_size"):
        deepspeed.moe.layer.MoE(8, torch.nn.Linear(8, 8), num_experts=3, ep_size=2)
    split = deepspeed.moe.layer.MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2)
    with pytest.raises(RuntimeError, match="shardwise.initialize"):
        split(torch.randn(2, 5, 8))  # no expert groups yet


ZERO1 = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 300}}
ZERO2 = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 300}}
BF16 = {"bf16": {"enabled": True}}

# (name, world, ep, gas, clip, k, extra config); small buckets: several per replica group
LAYOUTS = [
    ("ep2-top1", 2, 2, 1, 0.0, 1, {}),
    ("ep4-top2-gas2-clip", 4, 4, 2, 0.05, 2, {}),
    ("ep2xdp2-zero2-top1-clip", 4, 2, 1, 0.05, 1, ZERO2),
    ("ep2-zero1-top2-gas2", 2, 2, 2, 0.0, 2, ZERO1),
    ("ep2-bf16-zero2-clip", 2, 2, 1, 0.05, 1, {**ZERO2, **BF16}),
]


@pytest.mark.parametrize("name,world,ep,gas,clip,k,extra", LAYOUTS, ids=[row[0] for row in LAYOUTS])
def test_expert_parallel_trains_like_one_process(name, world, ep, gas, clip, k, extra):
    """Losses of every micro-batch, the final parameters (ep_size=1 names) and the number
    of all-to-alls: 2 forward and 2 backward per micro-batch. bf16: gradients rounded to 8
    bits of mantissa before the sum, parameters bf16 roundings of the fp32 masters (as
    test_zero.py): 1e-2 relative on losses, 4e-3 on parameters."""
    bf16 = "bf16" in extra
    rel, atol = (1e-2, 4e-3) if bf16 else (1e-5, 2e-6)
    want = reference_run(setup(world, gas, clip, k), STEPS, split=world * gas)
    results = run_distributed(engine_run, world, world, ep, gas, clip, k, **extra)
    for rank, got in enumerate(results):
        tag = f"layout {name} rank {rank}"
        assert got["start_equal"] or bf16, f"{tag}: single-process weights did not load"
        mine = [loss for step in want["micro_losses"] for loss in step[rank::world]]
        losses = [loss for step in got["losses"] for loss in step]
        assert losses == pytest.approx(mine, rel=rel, abs=1e-6), tag
        # The global norm counts every expert once (on one rank of its group or its owner).
        if clip:
            assert got["norms"] == pytest.approx(want["norms"], rel=2 * rel), f"{tag}: norms"
        assert got["params"].keys() == want["params"].keys(), f"{tag}: names"
        for key, w in want["params"].items():
            diff = float((got["params"][key].float() - w).abs().max())
            assert diff <= atol, f"{tag}: {key} differs by {diff:.2e}"
        assert got["a2a_calls"] == 4 * gas * 4, f"{tag}: {got['a2a_calls']} all-to-alls"
    assert not clip or max(want["norms"]) > clip, f"{name}: clipping never engaged; void test"


def _dropping_run(capacity_factor: float, drop_tokens: bool) -> dict:
    """EP2 forward with a small capacity: each rank's output and counts, same weights."""
    moe = {"use_rts": False, "drop_tokens": drop_tokens}
    whole = seed_experts(MoENet(1, 1, capacity_factor, **moe))
    config = {
        "train_micro_batch_size_per_gpu": MB,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    model = MoENet(2, 1, capacity_factor, **moe)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.load_module_state_dict(whole)
    x, _ = make_data(MB * 2)
    rows = slice(engine.dp_rank * MB, (engine.dp_rank + 1) * MB)
    h = torch.tanh(engine.module.inp(x[rows]))
    out, _, counts = engine.module.moe(h)
    return {"out": out.detach(), "counts": counts}


@pytest.mark.parametrize("drop_tokens", [True, False], ids=["drop", "no-drop"])
def test_dropped_tokens_match_the_single_process_gate(drop_tokens):
    """Capacity factor 0.5: with dropping, EP2 drops the tokens the single-process gate drops
    on the same tokens (counts and outputs equal, some rows zero); with drop_tokens=False the
    capacity grows to the largest count over the expert-parallel group and nothing drops."""
    factor, moe = 0.5, {"use_rts": False, "drop_tokens": drop_tokens}
    results = run_distributed(_dropping_run, 2, factor, drop_tokens)
    model = MoENet(1, 1, factor, **moe)
    model.load_state_dict(seed_experts(MoENet(1, 1, factor, **moe)))
    x, _ = make_data(MB * 2)
    for rank, got in enumerate(results):
        tag = f"rank {rank} drop_tokens={drop_tokens}"
        h = torch.tanh(model.inp(x[rank * MB : (rank + 1) * MB]))
        out, _, counts = model.moe(h)
        assert torch.equal(got["counts"], counts), f"{tag}: exp_counts"
        zero_rows = int((got["out"].abs().sum(-1) == 0).sum())
        assert zero_rows == int((out.abs().sum(-1) == 0).sum()), f"{tag}: dropped"
        assert (zero_rows > 0) == drop_tokens, f"{tag}: {zero_rows} tokens dropped"
        assert torch.allclose(got["out"], out.detach(), atol=1e-6), f"{tag}: outputs"


def test_checkpoint_of_ep2_x_dp2_loads_into_ep4_and_into_one_process(tmp_path):
    """Saved by EP2 x DP2 under ZeRO-2 (experts sharded over their expert-data group), loaded
    by EP4 at stage 0 and by one process holding every expert: the same weights, and the
    next step (SGD momentum restored) lands on the same weights."""
    path = str(tmp_path / "ckpt")
    results = run_distributed(checkpoint_run, 4, path, (2, 2), (4, 0))
    got = results[0]
    for key, saved in got["saved"].items():
        assert torch.equal(got["loaded"][key], saved), f"EP4 loaded {key} differs"
        diff = float((got["after_b"][key] - got["after_a"][key]).abs().max())
        assert diff <= 2e-6, f"EP4 after a step: {key} differs by {diff:.2e} (momentum?)"
    assert got["saved"].keys() == MoENet(1).state_dict().keys(), "single-process names"
    one = _engine(1, 0)
    one.load_checkpoint(path, tag="t")
    for key, value in one.consolidated_state_dict().items():
        assert torch.equal(value, got["saved"][key]), f"one process loaded {key} differs"


def test_topo_prints_the_expert_axis():
    """DeepSpeed's layout: ep consecutive data ranks split the experts; the ranks holding the
    same experts (strided by ep) reduce their gradients together."""
    out = topo_command(make_parser().parse_args(["topo", "--dp", "4", "--ep", "2"]))
    assert "expert-parallel groups (ep=2, 2 groups): [0, 1] [2, 3]" in out, out
    assert "expert-data groups (ep=2, 2 groups): [0, 2] [1, 3]" in out, out
    with pytest.raises(ValueError, match="ep_size=3 must divide"):
        topo_command(make_parser().parse_args(["topo", "--dp", "4", "--ep", "3"]))


def test_deepspeed_tutorial_parameter_groups_train_expert_parallel():
    """The tutorial's optimizer groups (dense, then "moe": True per expert group) train EP2
    under ZeRO-1: the loss falls on a repeated batch on both ranks."""
    for rank, got in enumerate(run_distributed(tutorial_run, 2)):
        assert got["groups"] == [("parameters", None), ("ep_size_2", True)], got["groups"]
        assert got["losses"][-1] < got["losses"][0], f"rank {rank}: {got['losses']}"


def _broadcast_with_a_lone_copy() -> dict:
    """Rank r holds its own copy of ``lone`` (an expert whose data-parallel group is one rank,
    recorded as None, which torch reads as the world) and shares ``shared`` with the world."""
    from shardwise.parallel.data.reducer import broadcast_parameters
    from shardwise.parallel.data.replica_groups import set_replicas

    rank = torch.distributed.get_rank()
    module = torch.nn.ParameterDict(
        {"shared": torch.nn.Parameter(torch.full((3,), float(rank))),
         "lone": torch.nn.Parameter(torch.full((2,), float(rank)))}
    )  # fmt: skip
    set_replicas(module["lone"], None, [rank], [[0], [1]])
    broadcast_parameters(module, src=0, group=None)
    return {k: v.detach().clone() for k, v in module.items()}


def test_a_parameter_only_this_rank_holds_is_not_broadcast():
    """GPT-MoE at TP2 deadlocked in initialize: each rank broadcast its lone expert copy on
    'the world' from itself (found by shardwise verify --fuzz)."""
    for rank, got in enumerate(run_distributed(_broadcast_with_a_lone_copy, 2, timeout=60)):
        assert got["shared"].tolist() == [0.0] * 3, f"rank {rank}: shared not from rank 0"
        assert got["lone"].tolist() == [float(rank)] * 2, f"rank {rank}: its own copy changed"
