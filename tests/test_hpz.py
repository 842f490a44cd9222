"""hpZ (``zero_optimization.zero_hpz_partition_size`` = H): ZeRO-3 keeping a secondary copy of
the parameter shards within groups of H data ranks trains like one process, gathers across
all ranks only once per step, and checkpoints into flat ZeRO-3 and back.

Reference of record: ``one_process.reference_run`` of ``equivalence.setup`` at dp 4 (4 local
gloo processes), H = 2 (two "hosts" of two ranks).

Tolerance (fp32, SGD): losses within 1e-5 relative, norms 2e-5, parameters 2e-6 absolute, the
bounds of flat ZeRO-3 (test_zero.py): hpZ changes no arithmetic, a gather only moves values, so
the only difference from one process is flat ZeRO's order of the gradient sum (a few ulps). A
stale secondary shard (values from before a step or a load) puts the previous weights into the
backward: the parameters then differ by lr x gradient changes, about 1e-3, from step 2 on.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import STEPS, assert_layout_matches, engine_run, setup
from harness import run_distributed
from one_process import reference_run

from shardwise.config import ConfigError, parse_config

CLIP = 0.05
DP, H = 4, 2
RECOMPUTE = {"activation_checkpointing": {"checkpoint_layers": ["fc1", "fc2"]}}


def zero(size: int = H, **extra) -> dict:
    """Stage 3 with hpZ; the biases whole (persistent), the weights sharded."""
    return {
        "stage": 3,
        "zero_hpz_partition_size": size,
        "stage3_param_persistence_threshold": 40,
        **extra,
    }


# (name, H, gas, config extras): H = 2 is two groups of two; accumulation (gas 3) gathers later
# micro-batches from the secondary shards; the recompute of checkpointed layers gathers inside
# backward; H = 4 = dp keeps the secondary over every rank (a copy of the primary partition);
# offload_param keeps the secondary beside the primary shard (host memory; the same here).
LAYOUTS = [
    ("h2", 2, 1, {}),
    ("h2-gas3", 2, 3, {}),
    ("h2-recompute", 2, 1, RECOMPUTE),
    ("h4", 4, 1, {}),
    ("h2-offload-param", 2, 1, {"zero_optimization": zero(offload_param={"device": "cpu"})}),
]


@pytest.mark.parametrize("name,size,gas,extra", LAYOUTS, ids=[row[0] for row in LAYOUTS])
def test_hpz_trains_like_one_process(name, size, gas, extra):
    want = reference_run(setup(DP, gas, CLIP, "sgd"), STEPS)
    config = {"zero_optimization": zero(size), **extra}
    results = run_distributed(engine_run, DP, DP, gas, CLIP, "sgd", **config)
    # Clipping engages (assert_layout_matches checks it): the norm is flat ZeRO-3's.
    assert_layout_matches(results, want, f"hpz {name}", "sgd", "fp32", CLIP)
    for rank, r in enumerate(results):
        # Each rank keeps P/H of each sharded unit (the weights of TinyMLP: 16x32, 32x32, 32x4).
        secondary = r["memory"]["hpz_secondary"]
        assert secondary == 4 * (16 * 32 + 32 * 32 + 32 * 4) // size, f"{name} rank {rank}"


def test_hpz_is_flat_zero3_bit_for_bit():
    """hpZ moves values only (a gather from the secondary shards returns the same bits as one
    over all ranks), so it equals flat ZeRO-3 exactly, not merely within the tolerance above."""
    flat = {"stage": 3, "stage3_param_persistence_threshold": 40}
    runs = {
        name: run_distributed(engine_run, DP, DP, 3, CLIP, "sgd", zero_optimization=block)
        for name, block in (("flat", flat), ("hpz", zero()))
    }
    for rank, (a, b) in enumerate(zip(runs["flat"], runs["hpz"], strict=True)):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"], f"rank {rank}"
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), f"rank {rank}: {name}"


def _step_calls(gas: int, **extra) -> dict:
    """The collectives of one optimizer step after a warm-up step: (op, group) -> calls, the
    group named "hpz" (a secondary group) or by its size."""
    from equivalence import MB, engine_config
    from models import make_data, make_model

    import shardwise
    from shardwise import comm
    from shardwise.parallel.zero.hpz import hpz_groups

    config = engine_config(gas, CLIP, "sgd", zero_optimization=zero(), **extra)
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    x, y = make_data(MB * DP)
    rows = slice(MB * engine.dp_rank, MB * (engine.dp_rank + 1))
    for _ in range(2):  # the recorder keeps the last 256 calls: mark where the step starts
        mark = comm.recorder().recent()[-1].start
        for _ in range(gas):
            engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
    groups = {tuple(g) for g in hpz_groups(engine.mesh.topology, H)}
    calls: dict = {}
    for c in comm.recorder().recent():
        if c.start > mark:
            ranks = tuple(c.group.ranks)
            key = (c.op, "hpz" if ranks in groups else len(ranks))
            calls[key] = calls.get(key, 0) + 1
    units = len([u for u in engine.strategy.units if not u.persistent])
    return {"calls": calls, "units": units}


# (name, gas, extras, gathers in the secondary group per unit and step): the first forward
# after a step gathers over all 4 ranks; every other gather (each backward, the forwards of
# later micro-batches) inside the group of 2. A checkpointed layer's recompute gathers its unit
# inside backward and keeps it until its gradient is reduced: still one backward gather.
CALL_CASES = [
    ("gas1", 1, {}, 1),
    ("gas2", 2, {}, 3),
    ("recompute", 1, RECOMPUTE, 1),
]


@pytest.mark.parametrize("name,gas,extra,inside", CALL_CASES, ids=[c[0] for c in CALL_CASES])
def test_the_comm_log_shows_one_gather_across_all_ranks_per_step(name, gas, extra, inside):
    for rank, got in enumerate(run_distributed(_step_calls, DP, gas, **extra)):
        calls, units, tag = got["calls"], got["units"], f"{name} rank {rank}: {got['calls']}"
        assert calls[("all_gather", DP)] == units, f"{tag}: one crossing gather per unit"
        assert calls[("all_gather", "hpz")] == inside * units, tag
        assert calls[("reduce_scatter", DP)] == gas * units, f"{tag}: over all ranks"
        assert {g for _, g in calls} <= {"hpz", DP}, tag


@pytest.mark.parametrize(
    "block,match",
    [
        ({"stage": 2, "zero_hpz_partition_size": 2}, '"stage": 3'),
        ({"stage": 0, "zero_hpz_partition_size": 4}, '"stage": 3'),
        ({"stage": 3, "zero_hpz_partition_size": 2, "mics_shard_size": 2}, "use one of the two"),
        (
            {"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True},
            "do not combine yet",
        ),
    ],
)
def test_hpz_refuses_what_it_cannot_do(block, match):
    with pytest.raises(ConfigError, match=f"zero_hpz_partition_size.*{match}") as err:
        parse_config({"train_batch_size": 4, "zero_optimization": block})
    assert err.value.key == "zero_optimization.zero_hpz_partition_size", block


@pytest.mark.parametrize("size", [0, 1])
def test_a_partition_size_of_one_or_less_is_off_as_in_deepspeed(size):
    from shardwise.parallel.zero.hpz import HpzStrategy

    block = {"stage": 2, "zero_hpz_partition_size": size}  # accepted: off, nothing to refuse
    cfg = parse_config(
        {"train_batch_size": 4, "gradient_clipping": 1.0, "zero_optimization": block}
    )
    ctx = type("Ctx", (), {"config": cfg})()
    assert not HpzStrategy.accepts(ctx), size


def test_the_partition_size_must_divide_the_data_ranks():
    from shardwise.parallel.zero.hpz import hpz_groups
    from shardwise.topology import Topology

    with pytest.raises(ConfigError, match=r"zero_hpz_partition_size=3 does not divide the 4"):
        hpz_groups(Topology.build(4), 3)
    assert hpz_groups(Topology.build(8, pp=2), 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert hpz_groups(Topology.build(4), 4) == [[0, 1, 2, 3]]


def test_topo_prints_the_secondary_groups():
    from shardwise.launch.cli import make_parser, topo_command

    argv = ["topo", "--nnodes", "2", "--nproc-per-node", "4", "--zero-hpz-partition-size", "4"]
    text = topo_command(make_parser().parse_args(argv))
    want = "ZeRO-3 secondary groups (hpZ, 4 ranks each): [0, 1, 2, 3] [4, 5, 6, 7]"
    assert want in text, text


HPZ3 = zero()
CKPT_LAYOUTS = {  # name: (world size, config keys); the global batch is 8 in each
    "single": (1, {}),
    "zero3-dp2": (2, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40}}),
    "hpz3-dp4": (4, {"zero_optimization": HPZ3}),
}
CKPT_PAIRS = [("hpz3-dp4", "zero3-dp2"), ("zero3-dp2", "hpz3-dp4")]


def _train_after_a_forward(cfg: dict, steps: int, load_from: str) -> dict:
    """``checkpointing.train`` with one forward before the load: the load must invalidate the
    secondary shards that forward filled (else the next gathers return the old weights)."""
    from checkpointing import dataset, engine_for, load

    engine = engine_for(cfg, 0.0, seed=99)
    with torch.no_grad():
        engine(dataset()[:4][0])
    load(engine, load_from)
    losses = [engine.train_batch().item() for _ in range(steps)]
    params = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return {"losses": losses, "params": params}


@pytest.mark.parametrize("saved, loaded", CKPT_PAIRS, ids=[f"{a}->{b}" for a, b in CKPT_PAIRS])
def test_an_hpz_checkpoint_loads_into_flat_zero3_and_back(saved, loaded, tmp_path):
    """3 steps under ``saved``, save, load under ``loaded``, 3 more: as 6 steps of one process
    (test_checkpoint_reshard.py's contract and AdamW tolerances). The checkpoint is flat
    ZeRO-3's: the secondary shards are a cache of the primary ones and are not saved."""
    from checkpointing import config, train
    from equivalence import assert_params_match
    from test_checkpoint_resume import on_world

    def cfg(name: str) -> dict:
        world, extra = CKPT_LAYOUTS[name]
        return config(train_micro_batch_size_per_gpu=8 // world, **extra)

    want = train(cfg("single"), 6)
    before = on_world(CKPT_LAYOUTS[saved][0], train, cfg(saved), 3, 0.0, str(tmp_path), None)
    after = on_world(CKPT_LAYOUTS[loaded][0], _train_after_a_forward, cfg(loaded), 3, str(tmp_path))
    for rank, r in enumerate(before):
        assert r["losses"] == pytest.approx(want["losses"][:3], rel=1e-5), f"{saved} rank {rank}"
    for rank, r in enumerate(after):
        tag = f"{saved} -> {loaded} rank {rank}"
        assert r["losses"] == pytest.approx(want["losses"][3:], rel=1e-5), tag
        assert_params_match(r["params"], want["params"], "adamw", tag)


def _changed_on_rank_0() -> dict:
    """Rank 0 alone writes into every parameter under GatheredParameters(modifier_rank=0); the
    gathers after it (the state dict's) come from the secondary shards the block's gather
    filled, so the block's exit must re-cut them from the broadcast values."""
    from equivalence import engine_config
    from models import make_model

    import shardwise
    from shardwise import comm
    from shardwise.parallel.zero.partition import GatheredParameters

    config = engine_config(1, CLIP, "sgd", zero_optimization=zero())
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    params = list(engine.module.parameters())
    with GatheredParameters(params, modifier_rank=0), torch.no_grad():
        if comm.get_rank() == 0:
            for p in params:
                p.fill_(0.5)
    return engine.consolidated_state_dict()


def test_a_change_on_one_rank_reaches_the_secondary_shards():
    for rank, state in enumerate(run_distributed(_changed_on_rank_0, DP)):
        for name, value in state.items():
            assert torch.all(value == 0.5), f"rank {rank}: {name} kept its old values"


def test_the_planner_weighs_hpz_with_its_bytes_per_link_class():
    """2 nodes x 4 ranks, ZeRO-3 at dp 8, every unit sharded: hpZ at H = 4 (one node) sends
    per unit 2 (N-1)/N P across nodes (the first gather and the reduce-scatter) instead of flat
    ZeRO-3's 3 (N-1)/N P, and (H-1)/H P inside the node (the backward gather); its secondary
    shards add P/H per rank (4 bytes an element in fp32), the other states stay flat ZeRO-3's.
    The config it writes runs hpZ."""
    from dataclasses import replace

    from shardwise.plan import PRESETS, Dims, Planner, build, read_model
    from shardwise.plan.candidates import candidates, to_config
    from shardwise.plan.memory import Options

    cluster = replace(PRESETS["a100-80g"], nodes=2, procs_per_node=4)
    d = Dims(layers=2, hidden=64, heads=4, vocab=512, seq=16)
    sharded = Options(persistence_threshold=0)
    planner = Planner(read_model(build(d)), cluster, 8, 16, "fp32", sharded)
    lays = [lay for lay in candidates(planner.shape, 8, 4, 8) if lay.tp == lay.pp == 1]
    assert {lay.hpz for lay in lays if lay.zero_stage == 3} == {0, 4}, "hpZ at a node's ranks"
    assert {lay.hpz for lay in lays if lay.zero_stage < 3} == {0}, "stage 3 only"
    assert not any(lay.hpz and lay.mics for lay in lays), "never with MiCS"
    flat = next(lay for lay in lays if lay.zero_stage == 3 and not lay.mics and lay.grad_accum == 1)
    got, want = planner.evaluate(replace(flat, hpz=4)), planner.evaluate(flat)
    cross, inside = got["link_bytes"]["inter_node"], got["link_bytes"]["intra_node"]
    assert cross == pytest.approx(want["link_bytes"]["inter_node"] * 2 / 3, rel=1e-3), got
    assert inside == pytest.approx(cross / 2 * (3 / 4) / (7 / 8), rel=1e-3), "(H-1)/H P"
    secondary = got["memory"]["hpz_secondary"]
    assert secondary == pytest.approx(want["memory"]["params"] * 8 / 4, rel=0.01), "P/H"
    assert got["memory"]["peak"] == want["memory"]["peak"] + secondary, (got, want)
    assert (
        to_config(replace(flat, hpz=4), "fp32")["zero_optimization"]["zero_hpz_partition_size"] == 4
    )
    assert "hpz4" in replace(flat, hpz=4).name()
