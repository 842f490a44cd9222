"""One rank of a large world, set up for real in this process (issue 16 part 3).

``shardwise.plan.simulate`` runs ``shardwise.initialize`` unchanged on torch's fake process
group with fake tensors (no storage): rank 517 of 1,024 for a 70B Llama in dp 16 x pp 8 x tp
8 with ZeRO-1, and rank 37 of 64 for a 7B Llama with ZeRO-3. What the rank ends up holding
must be what the planner predicts for it (shapes of every parameter, the pipeline partition,
the buckets or units, the model-state bytes), the rank tables must agree with the topology's
arithmetic, and no tensor the setup makes may be a whole parameter that the layout splits.
A real 2-process run checks the meta-device path the simulation relies on: a model built on
the meta device with ZeRO-1 and tensor parallelism is materialized only once cut.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from harness import run_distributed

from shardwise.launch.cli import main
from shardwise.plan import PRESETS, Dims, Layout, Planner, build, read_model
from shardwise.plan.memory import buckets, stage_params, zero3_units
from shardwise.plan.simulate import pipeline_model, simulate
from shardwise.topology import Topology

LLAMA_70B = Dims(80, 8192, 64, 128_256, 4096, kv_heads=8, ffn=28_672, arch="llama")
LLAMA_7B = Dims(32, 4096, 32, 32_000, 4096, ffn=11_008, arch="llama")
# (name, dims, layout, rank)
CASES = [
    ("70b-zero1-dp16-pp8-tp8", LLAMA_70B, Layout(16, 8, 8, 1, 1, 16), 517),
    ("7b-zero3-dp64", LLAMA_7B, Layout(64, 1, 1, 3, 1, 1), 37),
]


@functools.cache
def _setup(dims: Dims, layout: Layout, rank: int, whole: bool = True):
    shape = read_model(build(dims))
    planner = Planner(shape, PRESETS["a100-80g"], layout.global_batch, dims.seq, "bf16")
    model = pipeline_model(build(dims), layout.pp)
    engine, made = simulate(model, layout, rank, "bf16", shape, whole=whole)
    return planner, engine, made


def _whole_shapes(planner: Planner, layout: Layout) -> set[tuple[int, ...]]:
    """Whole shapes of the parameters ``layout`` splits or shards (leaving out a whole shape
    that is also another parameter's split shape: 70B's q_proj slice is k_proj's size)."""
    split = layout.tp > 1 or layout.zero_stage == 3
    local = {p.local_shape(layout.tp) for p in planner.shape.params} if layout.tp > 1 else set()
    return {p.shape for p in planner.shape.params if split and p.numel >= 1 << 20} - local


@pytest.mark.parametrize("name,dims,layout,rank", CASES, ids=[c[0] for c in CASES])
def test_simulated_rank_holds_what_the_planner_predicts(name, dims, layout, rank):
    planner, engine, made = _setup(dims, layout, rank)
    topo = Topology(dp=layout.dp, pp=layout.pp, tp=layout.tp)
    coord = topo.coord(rank)
    mesh = engine.mesh
    assert (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) == (coord.pp, coord.dp, coord.tp), name
    for axis in ("pp", "dp", "tp"):  # the live groups are the topology's arithmetic
        assert mesh.axis_ranks(axis) == topo.peers(rank, axis), f"{name}: {axis} group"
    row = [line.split() for line in topo.rank_table().splitlines()[2:]]
    assert [int(x) for x in row[rank][-3:]] == [coord.pp, coord.dp, coord.tp], name
    stage = coord.pp
    held = engine.memory_breakdown()
    states = planner.model_states(layout, stage)
    assert held["params"] == states.params, f"{name}: parameter bytes"
    assert held["optimizer"] == states.masters, f"{name}: fp32 masters (no step yet)"
    params = stage_params(planner.shape, planner.bounds(layout.pp), stage)
    if layout.zero_stage == 3:
        units = zero3_units(params, layout.dp, 100_000, 2**62)
        got = [u.shard.numel() for u in engine.strategy.units]
        assert got == [u.padded if pers else u.shard_numel for u, pers in units], name
        sharded = sum(u.shard_numel for u, pers in units if not pers)
        assert held["grads"] == 2 * sharded, f"{name}: gradient shards (bf16)"
    else:
        want = [p.local_shape(layout.tp) for p in params]
        got = [tuple(p.shape) for p in engine.module.parameters()]
        assert got == want, f"{name}: every parameter's local shape"
        lays = buckets(params, layout.tp, layout.dp, 2**22, set())
        assert [b.layout.padded for b in engine.strategy.buckets] == [x.padded for x in lays]
        assert held["grads"] == states.grads, f"{name}: gradient bytes"
    whole = _whole_shapes(planner, layout)
    sizes = {a * b for a, b in whole}
    assert whole, f"{name}: the check below would check nothing"
    for numel, shape, op in made.made:  # nothing the setup made is a whole split parameter
        assert shape not in whole and not (len(shape) == 1 and numel in sizes), (
            f"{name}: {op} made a tensor of shape {shape}"
        )


def test_pipeline_partition_is_the_planners():
    """The 70B's 82 layers (embedding, 80 blocks, head) on 8 stages: rank 517's stage holds
    the layers the planner assigns it, under their pipeline names."""
    planner, engine, _ = _setup(LLAMA_70B, Layout(16, 8, 8, 1, 1, 16), 517)
    lo, hi = planner.bounds(8)[4], planner.bounds(8)[5]
    indices = {int(n.split(".")[0]) for n, _ in engine.module.named_parameters()}
    assert indices == set(range(lo, hi)), (lo, hi, sorted(indices))


def test_meta_model_is_cut_before_it_is_materialized():
    """Handed the 70B on the meta device, the rank draws values only for its own split
    modules: each split weight's initial value is drawn whole once (reset_parameters, so that
    every split of it has the values of an unsplit layer), then only its slice is kept."""
    layout = Layout(16, 8, 8, 1, 1, 16)
    planner, engine, made = _setup(LLAMA_70B, layout, 517, whole=False)
    drawn = Counter(shape for _, shape, op in made.made if op.startswith("aten.empty"))
    # Stage 4 holds 10 blocks: q and o (8192 x 8192), gate and up (28672 x 8192), down
    # (8192 x 28672) drawn whole once each; the embedding and head live on other stages.
    want = {(8192, 8192): 20, (28672, 8192): 20, (8192, 28672): 10, (128256, 8192): 0}
    assert {shape: drawn[shape] for shape in want} == want
    want = [p.local_shape(8) for p in stage_params(planner.shape, planner.bounds(8), 4)]
    assert [tuple(p.shape) for p in engine.module.parameters()] == want
    held = engine.memory_breakdown()
    assert held["params"] == planner.model_states(layout, 4).params


def test_cli_simulate_prints_the_rank(capsys):
    flags = ["--arch", "llama", "--layers", "80", "--hidden", "8192", "--heads", "64"]
    flags += ["--kv-heads", "8", "--ffn", "28672", "--vocab", "128256", "--seq", "4096"]
    flags += ["--nodes", "128", "--procs-per-node", "8", "--global-batch", "1024"]
    flags += ["--simulate", "517", "--dp", "16", "--tp", "8", "--pp", "8", "--zero-stage", "1"]
    flags += ["--micro-batch", "1", "--schedule", "1f1b"]
    assert main(["plan", *flags]) == 0
    out = capsys.readouterr().out
    assert "rank 517 of 1024: pp 4, dp 0, tp 5" in out
    assert "42.mlp.gate_proj.weight: (3584, 8192)" in out  # 28672 / 8 rows, layer 42 = block 41
    predicted, held = (line for line in out.splitlines() if "params" in line and "grads" in line)
    assert predicted.split("params ")[1].split(",")[0:3] == held.split("params ")[1].split(",")[0:3]


def _meta_zero1_tp2() -> list:
    import shardwise

    d = Dims(layers=2, hidden=32, heads=2, vocab=61, seq=16, arch="llama")
    torch.manual_seed(0)
    model = build(d)  # on the meta device
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"size": 2},
    }
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    norm = engine.module.blocks[0].input_layernorm.weight
    return [float(loss), [tuple(p.shape) for p in engine.module.parameters()], norm.sum().item()]


def test_meta_model_trains_with_zero1_and_tensor_parallelism():
    """The library path the simulation takes, on real processes: nothing is meta after
    initialize, each rank holds its split shapes, and the tensor-parallel ranks agree."""
    (l0, shapes0, n0), (l1, shapes1, n1) = run_distributed(_meta_zero1_tp2, 2)
    assert l0 == pytest.approx(l1) and 3.5 < l0 < 4.8, (l0, l1)  # about ln(61)
    assert shapes0 == shapes1 and (16, 32) in shapes0, shapes0  # q_proj: 32 rows / 2
    assert n0 == n1
