"""DeepSpeed's ``deepspeed.runtime.pipe.topology`` names (docs/deepspeed-compat.md).

``ProcessTopology`` answers every case transcribed from DeepSpeed's own tests
(shared/reference/deepspeed-cases/topology_cases.json), and a ``PipelineModule(topology=...)``
trains exactly like ``num_stages=...`` (the same stages, so the same arithmetic: compared with
``torch.equal``), or is refused naming the key when its sizes disagree with the run's layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from test_pipe_module import SGD, mlp_layers

import shardwise
from shardwise.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

CASES = Path(__file__).resolve().parents[2] / "shared/reference/deepspeed-cases/topology_cases.json"
needs_reference = pytest.mark.skipif(not CASES.is_file(), reason=f"{CASES} missing")
REPR = {  # the case key -> get_rank_repr's arguments
    "get_rank_repr_default": {},
    "get_rank_repr_omit_pipe": {"omit_axes": ["pipe"]},
    "get_rank_repr_omit_none": {"omit_axes": []},
}


def _cases():
    cases = json.loads(CASES.read_text())["cases"] if CASES.is_file() else []
    return [pytest.param(c, id=f"{'-'.join(c['axes'])}={c['dims']}") for c in cases]


@needs_reference
@pytest.mark.parametrize("case", _cases())
def test_every_deepspeed_case(case):
    topo, name = ProcessTopology(case["axes"], case["dims"]), f"{case['axes']}={case['dims']}"
    checked = {"axes", "dims"}
    if "world_size" in case:
        assert topo.world_size() == case["world_size"], name
    for coords, rank in case.get("get_rank", []):
        assert topo.get_rank(**coords) == rank, f"{name}: get_rank({coords})"
    for rank, coords in case.get("get_coord", {}).items():
        assert list(topo.get_coord(int(rank))) == coords, f"{name}: get_coord({rank})"
    for axis, size in case.get("get_dim", {}).items():
        assert topo.get_dim(axis) == size, f"{name}: get_dim({axis})"
    for axis, index, ranks in case.get("get_axis_list", []):
        assert topo.get_axis_list(axis, index) == ranks, f"{name}: get_axis_list({axis}, {index})"
    for where, ranks in case.get("filter_match", []):
        assert topo.filter_match(**where) == ranks, f"{name}: filter_match({where})"
    for key, kwargs in REPR.items():
        for rank, text in case.get(key, {}).items():
            assert topo.get_rank_repr(int(rank), **kwargs) == text, f"{name}: {key} rank {rank}"
    if "get_rank_repr_inner_sep_plus_rank3" in case:
        got = topo.get_rank_repr(3, inner_sep="+")
        assert got == case["get_rank_repr_inner_sep_plus_rank3"], name
    checked |= {"world_size", "get_rank", "get_coord", "get_dim", "get_axis_list"}
    checked |= {"filter_match", "get_rank_repr_inner_sep_plus_rank3", *REPR}
    assert set(case) <= checked, f"{name}: keys nobody checks: {set(case) - checked}"


def test_the_two_pipeline_forms_and_their_groups():
    pd = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert (pd.get_axis_names(), pd.dims) == (["pipe", "data"], [2, 2])
    assert pd.get_axis_comm_lists("data") == [[0, 1], [2, 3]], "data peers within a stage"
    assert pd.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]]
    assert pd.get_axis_comm_lists("model") == [], "an absent axis has no groups"
    pmd = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert (pmd.get_axis_names(), pmd.dims) == (["pipe", "data", "model"], [2, 3, 2])
    assert pmd.get_axis_comm_lists("model")[:2] == [[0, 1], [2, 3]], "model peers consecutive"
    assert pmd.mesh_sizes() == {"pp": 2, "dp": 3, "tp": 2}


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ProcessTopology(["a", "b"], [2]), "one size per distinct axis"),
        (lambda: ProcessTopology(["a"], [0]), "integer >= 1"),
        (lambda: ProcessTopology(["a", "b"], [2, 2]).get_rank(a=1), "filter_match"),
        (lambda: ProcessTopology(["a"], [2]).get_rank(a=2), "outside 0..1"),
        (lambda: ProcessTopology(["a"], [2]).get_coord(2), "rank 2 not found"),
        (lambda: ProcessTopology(["a"], [2]).filter_match(b=0), "no axis"),
        (lambda: ProcessTopology(["row"], [2]).mesh_sizes(), "pipeline, data, tensor"),
    ],
)
def test_bad_calls_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _train(how: str) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    if how == "topology":
        module = shardwise.pipe.PipelineModule(
            mlp_layers(), topology=PipeDataParallelTopology(2, 1), loss_fn=F.mse_loss
        )
    else:
        module = shardwise.pipe.PipelineModule(mlp_layers(), num_stages=2, loss_fn=F.mse_loss)
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "optimizer": SGD}
    engine, *_ = shardwise.initialize(model=module, config=config)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)) for _ in range(6)]
    losses = [engine.train_batch(iter(data[2 * i : 2 * i + 2])).item() for i in range(3)]
    return losses, [p.detach().clone() for p in module.parameters()]


def _both() -> tuple[bool, bool, list[float]]:
    (la, pa), (lb, pb) = _train("topology"), _train("num_stages")
    return la == lb, all(torch.equal(a, b) for a, b in zip(pa, pb, strict=True)), la


def test_a_topology_builds_the_stages_num_stages_builds():
    for rank, (same_loss, same_params, losses) in enumerate(run_distributed(_both, 2)):
        assert same_loss, f"pp2 via PipeDataParallelTopology, rank {rank}: losses {losses}"
        assert same_params, f"pp2 via PipeDataParallelTopology, rank {rank}: parameters differ"


@pytest.mark.parametrize(
    "topology, key, match",
    [
        (PipeModelDataParallelTopology(1, 2, 1), "tensor_parallel.size", "model=2 but"),
        (PipeDataParallelTopology(1, 2), "", "data=2 but this run lays out dp=1"),
    ],
    ids=["model2-tp1", "data2-world1"],
)
def test_a_topology_that_disagrees_with_the_layout_is_refused(topology, key, match):
    module = shardwise.pipe.PipelineModule(mlp_layers(), topology=topology, loss_fn=F.mse_loss)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": SGD}
    with pytest.raises(shardwise.ConfigError, match=match) as err:
        shardwise.initialize(model=module, config=config)
    assert err.value.key == key, f"{topology.dims}: the error names {err.value.key!r}"
