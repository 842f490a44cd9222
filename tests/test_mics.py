"""MiCS / HSDP (``zero_optimization.mics_shard_size`` = S): ZeRO sharded within groups of S data
ranks and replicated across them trains like one process, communicates where it should, counts
each gradient element once and checkpoints into any layout.

Reference of record: ``one_process.reference_run`` of ``equivalence.setup`` (plain PyTorch, one
process, the whole global batch per step), at dp 4 (4 local gloo processes).

Tolerance (fp32, SGD): losses within 1e-5 relative, norms 2e-5, parameters 2e-6 absolute, the
bounds of flat ZeRO (test_zero.py). MiCS changes only the order of the additions: the N per-rank
gradients, each divided by N, are summed in two stages (S inside a group, then R across groups)
instead of one, a reordering that moves a sum of fp32 values by a few ulps (2^-23 relative each).
Counting each gradient element R times would give a norm sqrt(R) = 1.41x too large at S = 2, and a
stale or unreduced replica differs by whole gradient steps (lr 0.1 x gradients ~1e-2).
"""

from __future__ import annotations

import json

import pytest
import torch
from equivalence import STEPS, assert_layout_matches, engine_run, setup
from harness import run_distributed
from one_process import reference_run

from shardwise.config import ConfigError
from shardwise.topology import Topology, TopologyError

CLIP = 0.05
DP = 4


def zero(stage: int, shard: int, **extra) -> dict:
    """Small buckets (several per model, parameters straddling shards); stage 3 keeps the
    biases whole (persistent) and shards the weights."""
    block = {"stage": stage, "mics_shard_size": shard, "reduce_bucket_size": 300}
    if stage == 3:
        block["stage3_param_persistence_threshold"] = 40
    return {**block, **extra}


# (name, stage, S, gas): S = 1 is replicated data parallelism through ZeRO's machinery, S = 2 two
# replicas of two shards; accumulation (gas 3) defers the cross-group all-reduce to the boundary.
LAYOUTS = [
    ("z1-s1", 1, 1, 1),
    ("z1-s2", 1, 2, 1),
    ("z2-s1", 2, 1, 1),
    ("z2-s2", 2, 2, 1),
    ("z3-s1", 3, 1, 1),
    ("z3-s2", 3, 2, 1),
    ("z1-s2-gas3", 1, 2, 3),
    ("z2-s2-gas3", 2, 2, 3),
    ("z3-s2-gas3", 3, 2, 3),
]


@pytest.mark.parametrize("name,stage,shard,gas", LAYOUTS, ids=[row[0] for row in LAYOUTS])
def test_mics_layout_trains_like_one_process(name, stage, shard, gas):
    want = reference_run(setup(DP, gas, CLIP, "sgd"), STEPS)
    extra = {"zero_optimization": zero(stage, shard)}
    results = run_distributed(engine_run, DP, DP, gas, CLIP, "sgd", **extra)
    # Clipping engages (assert_layout_matches checks it), so a norm counted per replica would
    # change every update, not only the reported norm.
    assert_layout_matches(results, want, f"mics {name}", "sgd", "fp32", CLIP)


def _one_step_calls(stage: int, shard: int, **keys) -> dict:
    """The collectives of one optimizer step after a warm-up step: (op, group size) -> calls."""
    from equivalence import MB, engine_config
    from models import make_data, make_model

    import shardwise
    from shardwise import comm

    config = engine_config(1, CLIP, "sgd", zero_optimization=zero(stage, shard, **keys))
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    x, y = make_data(MB * DP)
    rows = slice(MB * engine.dp_rank, MB * (engine.dp_rank + 1))
    for _ in range(2):  # the recorder keeps the last 256 calls: mark where the step starts
        mark = comm.recorder().recent()[-1].start
        engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    shard, replicate = (engine.mesh.topology.zero_groups(k) for k in ("shard", "replicate"))
    names = {tuple(g): "shard" for g in shard} | {tuple(g): "replicate" for g in replicate}
    calls: dict = {}
    for c in comm.recorder().recent():
        if c.start > mark:
            key = (c.op, names.get(tuple(c.group.ranks), len(c.group.ranks)))
            calls[key] = calls.get(key, 0) + 1
    strategy = engine.strategy
    pieces = strategy.buckets if stage < 3 else [u for u in strategy.units if not u.persistent]
    return {"calls": calls, "pieces": len(pieces)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_comm_log_shows_gathers_in_the_group_and_one_all_reduce_across(stage):
    """Shard traffic (all-gather, reduce-scatter) in the shard group of S = 2; one all-reduce
    per bucket (stage 3: per sharded unit) over the replicate group; over all 4 data ranks only
    the persistent units' gradients (stage 3); the norm's scalar over the shard group."""
    for rank, got in enumerate(run_distributed(_one_step_calls, DP, stage, 2)):
        calls, tag = got["calls"], f"stage {stage} rank {rank}: {got['calls']}"
        assert {g for op, g in calls if op in ("all_gather", "reduce_scatter")} == {"shard"}, tag
        assert calls[("reduce_scatter", "shard")] == got["pieces"], tag
        assert calls[("all_reduce", "replicate")] == got["pieces"], f"{tag}: one per bucket"
        assert calls[("all_reduce", "shard")] == 1, f"{tag}: the norm, over the shard group"
        assert {g for _, g in calls} <= {"shard", "replicate", DP}, tag
        assert (("all_reduce", DP) in calls) == (stage == 3), f"{tag}: persistent gradients"


def test_shard_size_must_divide_the_data_ranks():
    with pytest.raises(TopologyError, match=r"mics_shard_size=3 does not divide the 4"):
        Topology.build(4, zero_shard=3)
    topo = Topology.build(8, tp=2, zero_shard=2)
    assert topo.zero_groups("shard") == [[0, 2], [4, 6], [1, 3], [5, 7]], topo
    assert topo.zero_groups("replicate") == [[0, 4], [2, 6], [1, 5], [3, 7]], topo
    assert "data 4 (2 replicas x shard 2)" in topo.describe(), topo.describe()


@pytest.mark.parametrize(
    "block,key",
    [
        ({"stage": 0, "mics_shard_size": 2}, "mics_shard_size"),
        ({"stage": 3, "mics_hierarchical_params_gather": True}, "mics_hierarchical_params_gather"),
        (
            {"stage": 2, "mics_shard_size": 2, "mics_hierarchical_params_gather": True},
            "mics_hierarchical_params_gather",
        ),
    ],
)
def test_mics_keys_refuse_what_they_cannot_do(block, key):
    from shardwise.config import parse_config

    with pytest.raises(ConfigError, match=key):
        parse_config({"train_batch_size": 4, "gradient_clipping": 1.0, "zero_optimization": block})


@pytest.mark.parametrize("shard", [-1, 0])
def test_a_shard_size_below_one_is_off_as_in_deepspeed(shard):
    from shardwise.config import parse_config

    cfg = parse_config(
        {
            "train_batch_size": 4,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "mics_shard_size": shard},
        }
    )
    assert cfg.zero_optimization.mics_shard == 0, shard


MICS3 = {"stage": 3, "mics_shard_size": 2, "stage3_param_persistence_threshold": 40}
CKPT_LAYOUTS = {  # name: (world size, config keys); the global batch is 8 in each
    "single": (1, {}),
    "zero2-dp2": (2, {"zero_optimization": {"stage": 2}}),
    "mics3-dp4": (4, {"zero_optimization": MICS3}),
    "mics1-dp4": (4, {"zero_optimization": {"stage": 1, "mics_shard_size": 2}}),
}
CKPT_PAIRS = [("mics3-dp4", "single"), ("zero2-dp2", "mics1-dp4")]


@pytest.mark.parametrize("saved, loaded", CKPT_PAIRS, ids=[f"{a}->{b}" for a, b in CKPT_PAIRS])
def test_a_mics_checkpoint_loads_into_a_flat_layout_and_back(saved, loaded, tmp_path):
    """3 steps under ``saved``, save, load under ``loaded``, 3 more: as 6 steps of one process
    (test_checkpoint_reshard.py's contract and AdamW tolerances). Each shard is written by
    one of its replicas: a shard written twice, or by none, fails the save or the load."""
    from checkpointing import config, train
    from equivalence import assert_params_match
    from test_checkpoint_resume import on_world

    def cfg(name: str) -> dict:
        world, extra = CKPT_LAYOUTS[name]
        return config(train_micro_batch_size_per_gpu=8 // world, **extra)

    want = train(cfg("single"), 6)
    before = on_world(CKPT_LAYOUTS[saved][0], train, cfg(saved), 3, 0.0, str(tmp_path), None)
    after = on_world(CKPT_LAYOUTS[loaded][0], train, cfg(loaded), 3, 0.0, None, str(tmp_path))
    for rank, r in enumerate(before):
        assert r["losses"] == pytest.approx(want["losses"][:3], rel=1e-5), f"{saved} rank {rank}"
    manifest = json.loads((tmp_path / "global_step3" / "manifest.json").read_text())
    for name, t in manifest["tensors"].items():
        boxes = [json.dumps([p.get("box"), p.get("flat")]) for p in t["pieces"]]
        assert len(boxes) == len(set(boxes)), f"{saved}: {name} has a piece stored twice"
    sizes = [f["size"] for f in manifest["files"].values()]
    assert min(sizes) > sum(sizes) / (3 * len(sizes)), f"{saved}: unbalanced files {sizes}"
    for rank, r in enumerate(after):
        tag = f"{saved} -> {loaded} rank {rank}"
        assert r["losses"] == pytest.approx(want["losses"][3:], rel=1e-5), tag
        assert_params_match(r["params"], want["params"], "adamw", tag)


def test_topo_prints_the_replicate_axis():
    from shardwise.launch.cli import make_parser, topo_command

    args = make_parser().parse_args(["topo", "--world-size", "4", "--mics-shard-size", "2"])
    text = topo_command(args)
    assert "data 4 (2 replicas x shard 2)" in text, text
    assert text.splitlines()[1].split()[-2:] == ["replica", "shard"], text
    assert "ZeRO shard groups (MiCS, 2 ranks each): [0, 1] [2, 3]" in text, text
    assert "ZeRO replicate groups (MiCS, 2 ranks each): [0, 2] [1, 3]" in text, text


def test_the_planner_weighs_mics_with_its_bytes_per_link_class():
    """2 nodes x 4 ranks, ZeRO-3 at dp 8: MiCS at S = 4 (one node) keeps the gathers and
    reduce-scatters in the node; across nodes only the all-reduce of each unit's shard, 2 (R-1)/R
    of P/S = P/4 elements, against flat ZeRO-3's 3 (N-1)/N P = 2.6 P for sharded units; memory:
    states divided by 4 instead of 8. The config it writes runs MiCS."""
    from dataclasses import replace

    from shardwise.plan import PRESETS, Dims, Planner, build, read_model
    from shardwise.plan.candidates import candidates, to_config
    from shardwise.plan.memory import Options

    cluster = replace(PRESETS["a100-80g"], nodes=2, procs_per_node=4)
    d = Dims(layers=2, hidden=64, heads=4, vocab=512, seq=16)
    sharded = Options(persistence_threshold=0)  # every unit sharded (the model is small)
    planner = Planner(read_model(build(d)), cluster, 8, 16, "fp32", sharded)
    lays = [lay for lay in candidates(planner.shape, 8, 4, 8) if lay.tp == lay.pp == 1]
    assert {lay.mics for lay in lays if lay.zero_stage} == {0, 4}, "MiCS at one node's data ranks"
    assert {lay.mics for lay in lays if not lay.zero_stage} == {0}, "stage 0 has nothing to shard"
    flat = next(
        lay for lay in lays if lay.zero_stage == 3 and lay.mics == 0 and lay.grad_accum == 1
    )
    mics = replace(flat, mics=4)
    got, want = planner.evaluate(mics), planner.evaluate(flat)
    assert got["link_bytes"]["inter_node"] < want["link_bytes"]["inter_node"] / 5, (got, want)
    assert want["link_bytes"]["intra_node"] == 0, "flat ZeRO's data group spans both nodes"
    assert got["memory"]["optimizer"] > 1.8 * want["memory"]["optimizer"], "S = 4, not 8"
    assert to_config(mics, "fp32")["zero_optimization"]["mics_shard_size"] == 4
    assert "mics4" in mics.name()


def _two_hop(fn, *args, **kwargs):
    """``fn`` with 2 processes per node (DeepSpeed's NDEV_PER_NODE): the 4 ranks are 2 nodes."""
    import os

    os.environ["NDEV_PER_NODE"] = "2"
    try:
        return fn(*args, **kwargs)
    finally:
        del os.environ["NDEV_PER_NODE"]


TWO_HOP = {"mics_hierarchical_params_gather": True}


@pytest.mark.parametrize("gas", [1, 2])
def test_the_two_hop_gather_trains_like_one_process(gas):
    """ZeRO-3, one shard group of 4 ranks on 2 nodes of 2: parameters gathered across the
    nodes, then inside them, then reordered; same tolerance as above (no arithmetic changes:
    a gather only moves values)."""
    want = reference_run(setup(DP, gas, CLIP, "sgd"), STEPS)
    extra = {"zero_optimization": zero(3, 4, **TWO_HOP)}
    results = run_distributed(_two_hop, DP, engine_run, DP, gas, CLIP, "sgd", **extra)
    assert_layout_matches(results, want, f"two-hop gas{gas}", "sgd", "fp32", CLIP)


def test_the_two_hop_gather_runs_in_node_and_cross_node_groups():
    got = run_distributed(_two_hop, DP, _one_step_calls, 3, 4, **TWO_HOP)
    for rank, r in enumerate(got):
        calls, tag = r["calls"], f"rank {rank}: {r['calls']}"
        assert calls[("reduce_scatter", "shard")] == r["pieces"], tag
        # Forward and backward gather each sharded unit: two hops of 2 ranks each time.
        assert calls[("all_gather", 2)] == 2 * 2 * r["pieces"], tag
        assert not any(op == "all_gather" and g != 2 for op, g in calls), tag


def test_a_two_hop_gather_within_one_node_is_refused():
    from shardwise.parallel.zero.mics import _hop_groups
    from shardwise.topology import ProcessMesh

    mesh = ProcessMesh(Topology(dp=4, zero_shard=4), rank=0)
    with pytest.raises(ConfigError, match="mics_hierarchical_params_gather.*at least 2 nodes"):
        _hop_groups(mesh, 4)


def _changed_on_rank_0() -> dict:
    """Rank 0 alone writes into every parameter under GatheredParameters(modifier_rank=0)."""
    from equivalence import engine_config
    from models import make_model

    import shardwise
    from shardwise import comm
    from shardwise.parallel.zero.partition import GatheredParameters

    config = engine_config(1, CLIP, "sgd", zero_optimization=zero(3, 2))
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    params = list(engine.module.parameters())
    with GatheredParameters(params, modifier_rank=0), torch.no_grad():
        if comm.get_rank() == 0:
            for p in params:
                p.fill_(0.5)
    return engine.consolidated_state_dict()


def test_a_change_on_one_rank_reaches_every_replica():
    """GatheredParameters' broadcast runs over all data ranks, not one shard group: else the
    other replica keeps the old values and the replicas drift apart silently."""
    for rank, state in enumerate(run_distributed(_changed_on_rank_0, DP)):
        for name, value in state.items():
            assert torch.all(value == 0.5), f"rank {rank}: {name} kept its old values"
