"""``Topology`` without processes: sizes, rank <-> coordinates, groups, the rank table.

The rank order is DeepSpeed's (row-major over (pipe, data, model), last axis fastest), checked
against the cases transcribed from DeepSpeed's own topology tests wherever they map onto our
(pp, dp, tp) axes: DeepSpeed's names map by meaning (pipe -> pp, data -> dp, model -> tp);
generic axes (a, b, c / row, col) are tried on every ordered choice of our axes, since axes
of size 1 change no rank.
"""

import itertools
import json
from pathlib import Path

import pytest
from harness import run_distributed

from shardwise import topology
from shardwise.topology import AXES, Coord, ProcessMesh, Topology, TopologyError, new_subgroup

REPO = Path(__file__).resolve().parents[1]
CASES = REPO.parent / "shared" / "reference" / "deepspeed-cases" / "topology_cases.json"
needs_reference = pytest.mark.skipif(
    not CASES.is_file(), reason=f"{CASES} missing (shared/ beside the repo)"
)

DEEPSPEED_AXES = {"pipe": "pp", "data": "dp", "model": "tp"}
CHECKED = {"get_rank", "get_axis_list", "get_dim", "get_coord", "filter_match"}
# get_rank_repr formats DeepSpeed's checkpoint-file suffixes: ProcessTopology has it, Topology
# does not (test_process_topology.py checks these keys).
NOT_MAPPED = {
    "get_rank_repr_default",
    "get_rank_repr_inner_sep_plus_rank3",
    "get_rank_repr_omit_pipe",
    "get_rank_repr_omit_none",
}
CASE_META = {"axes", "dims", "world_size"}


def _mappings(axes):
    """Every way to name DeepSpeed's axes with ours, keeping their order."""
    if set(axes) <= set(DEEPSPEED_AXES):
        return [{a: DEEPSPEED_AXES[a] for a in axes}]
    return [dict(zip(axes, ours, strict=True)) for ours in itertools.combinations(AXES, len(axes))]


def _mapped_cases():
    cases = json.loads(CASES.read_text())["cases"] if CASES.is_file() else []
    out = []
    for i, case in enumerate(cases):
        for mapping in _mappings(case["axes"]):
            sizes = {
                ours: case["dims"][case["axes"].index(theirs)] for theirs, ours in mapping.items()
            }
            out.append(
                pytest.param(
                    case, mapping, Topology(**sizes), id=f"case{i}-{'-'.join(mapping.values())}"
                )
            )
    return out


def _matching(topo, mapping, where):
    """Ranks whose coordinates equal ``where`` (DeepSpeed's filter_match / get_axis_list)."""
    return [
        r
        for r in range(topo.world_size)
        if all(getattr(topo.coord(r), mapping[a]) == v for a, v in where.items())
    ]


@needs_reference
def test_every_case_key_is_checked_or_explained():
    for i, case in enumerate(json.loads(CASES.read_text())["cases"]):
        unknown = set(case) - CHECKED - NOT_MAPPED - CASE_META
        assert not unknown, f"case {i}: new keys {unknown}: test them or say why they do not map"


@needs_reference
@pytest.mark.parametrize("case, mapping, topo", _mapped_cases())
def test_deepspeed_topology_cases(case, mapping, topo):
    layout = f"{case['axes']}={case['dims']} as {mapping}"
    if "world_size" in case:
        assert topo.world_size == case["world_size"], layout
    for axis, size in case.get("get_dim", {}).items():
        assert topo.size(mapping[axis]) == size, f"{layout}: size of {axis}"
    for coords, rank in case.get("get_rank", []):
        assert topo.rank(**{mapping[a]: v for a, v in coords.items()}) == rank, (
            f"{layout}: rank of {coords}"
        )
    for rank, coords in case.get("get_coord", {}).items():
        got = topo.coord(int(rank))
        assert [getattr(got, mapping[a]) for a in case["axes"]] == coords, (
            f"{layout}: coord of {rank}"
        )
    for axis, index, ranks in case.get("get_axis_list", []):
        assert _matching(topo, mapping, {axis: index}) == ranks, f"{layout}: {axis}={index}"
    for where, ranks in case.get("filter_match", []):
        assert _matching(topo, mapping, where) == ranks, f"{layout}: filter {where}"


def test_deepspeed_derived_notes():
    # PipeDataParallelTopology(num_pp=2, num_dp=2): stages [0,1] and [2,3], DP groups {0,2} {1,3}.
    topo = Topology(pp=2, dp=2)
    assert topo.axis_groups("dp") == [[0, 1], [2, 3]], "DP peers within a stage"
    assert topo.axis_groups("pp") == [[0, 2], [1, 3]]
    # PipeModelDataParallelTopology: model (TP) neighbours are consecutive ranks.
    assert Topology(pp=2, dp=2, tp=2).axis_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (3, 2, 1), (1, 3, 4), (2, 1, 3)]


@pytest.mark.parametrize("dp, pp, tp", LAYOUTS)
def test_rank_and_coord_are_inverse_and_row_major(dp, pp, tp):
    topo = Topology(dp=dp, pp=pp, tp=tp)
    for r in range(topo.world_size):
        c = topo.coord(r)
        assert topo.rank(pp=c.pp, dp=c.dp, tp=c.tp) == r, f"dp={dp} pp={pp} tp={tp} rank {r}"
        assert r == c.pp * dp * tp + c.dp * tp + c.tp, (
            f"dp={dp} pp={pp} tp={tp} rank {r}: row-major"
        )


@pytest.mark.parametrize("dp, pp, tp", LAYOUTS)
def test_axis_groups_partition_the_world(dp, pp, tp):
    topo = Topology(dp=dp, pp=pp, tp=tp)
    for axis in AXES:
        groups = topo.axis_groups(axis)
        layout = f"dp={dp} pp={pp} tp={tp} axis {axis}"
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size)), layout
        assert all(len(g) == topo.size(axis) for g in groups), layout
        for g in groups:
            coords = [topo.coord(r) for r in g]
            assert [getattr(c, axis) for c in coords] == list(range(topo.size(axis))), layout
            for other in set(AXES) - {axis}:
                assert len({getattr(c, other) for c in coords}) == 1, f"{layout}: {other} fixed"
            for r in g:
                assert topo.peers(r, axis) == g, f"{layout}: peers of {r}"


@pytest.mark.parametrize(
    "world, kwargs, expected",
    [
        (8, dict(pp=2, tp=2), Topology(dp=2, pp=2, tp=2)),
        (8, dict(), Topology(dp=8)),
        (6, dict(tp=3), Topology(dp=2, tp=3)),
        (4, dict(dp=2, pp=2), Topology(dp=2, pp=2)),
    ],
)
def test_build_fills_dp(world, kwargs, expected):
    assert Topology.build(world, **kwargs) == expected, (world, kwargs)


@pytest.mark.parametrize(
    "world, kwargs, named",
    [
        (8, dict(pp=3), "not divisible by pipeline 3 x tensor 1 = 3"),
        (
            8,
            dict(dp=3, pp=2),
            "data 3 x pipeline 2 x tensor 1 = 6 processes, but the world size is 8",
        ),
        (0, dict(), "world size 0"),
        (8, dict(tp=0), "tensor 0"),
    ],
)
def test_build_errors_print_every_factor(world, kwargs, named):
    with pytest.raises(TopologyError) as info:
        Topology.build(world, **kwargs)
    assert named in str(info.value), f"world {world} {kwargs}: {info.value}"


@pytest.mark.parametrize("sizes", [dict(dp=0), dict(pp=-1), dict(tp=1.5), dict(dp=True)])
def test_sizes_must_be_positive_integers(sizes):
    with pytest.raises(TopologyError, match="must be an integer >= 1"):
        Topology(**sizes)


def test_lookups_outside_the_mesh_fail():
    topo = Topology(dp=2, tp=2)
    with pytest.raises(IndexError, match="rank 4 outside"):
        topo.coord(4)
    with pytest.raises(IndexError, match="tp=2 outside"):
        topo.rank(tp=2)
    with pytest.raises(KeyError, match="unknown axis"):
        topo.size("ep")
    assert isinstance(topo.coord(3), Coord) and topo.coord(3) == Coord(pp=0, dp=1, tp=1)


def test_rank_table_places_ranks_on_nodes():
    table = Topology(dp=2, pp=2, tp=2).rank_table(nproc_per_node=4).splitlines()
    assert table[0] == "Topology: data 2 x pipeline 2 x tensor 2 = 8 processes"
    assert table[1].split() == ["rank", "host", "local_rank", "pp", "dp", "tp"]
    assert table[2].split() == ["0", "node0", "0", "0", "0", "0"]
    assert table[7].split() == ["5", "node1", "1", "1", "0", "1"]
    named = Topology(dp=2).rank_table(hosts=["gpu-a", "gpu-b"]).splitlines()
    assert [row.split()[1] for row in named[2:]] == ["gpu-a", "gpu-b"], "explicit hosts"
    single = Topology(dp=4).rank_table().splitlines()
    assert [row.split()[1:3] for row in single[2:]] == [["node0", str(r)] for r in range(4)], (
        "one node"
    )


def test_process_mesh_without_torch_distributed_has_no_groups():
    mesh = ProcessMesh.create(Topology(), rank=None)
    assert (mesh.rank, mesh.dp_group, mesh.pp_group, mesh.tp_group) == (0, None, None, None)
    mesh = ProcessMesh.create(Topology(dp=2, pp=2, tp=2), rank=5)  # arithmetic only
    assert (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) == (1, 0, 1)
    assert mesh.axis_ranks("dp") == [5, 7] and mesh.axis_ranks("pp") == [1, 5]
    assert (mesh.axis_size("tp"), mesh.axis_rank("tp")) == (2, 1)


class _FakeDist:
    """Just enough of torch.distributed to watch which groups are created, in which order."""

    def __init__(self, world, rank):
        self.world, self.rank, self.created = world, rank, []
        self.group = type("group", (), {"WORLD": "WORLD"})

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_rank(self):
        return self.rank

    def get_world_size(self):
        return self.world

    def new_group(self, ranks, timeout=None, group_desc=None):
        self.created.append(list(ranks))
        return f"group{list(ranks)}"


def test_process_mesh_creates_every_group_once_in_the_same_order(monkeypatch):
    orders = []
    for rank in (0, 5):
        fake = _FakeDist(world=8, rank=rank)
        monkeypatch.setattr(topology, "dist", fake)
        mesh = ProcessMesh.create(Topology(dp=2, pp=2, tp=2))
        orders.append(fake.created)
        assert mesh.rank == rank
        assert mesh.tp_group == f"group{Topology(dp=2, pp=2, tp=2).peers(rank, 'tp')}", (
            f"rank {rank}"
        )
        replica = [r for r in range(8) if Topology(dp=2, pp=2, tp=2).coord(r).dp == rank // 2 % 2]
        assert mesh.model_parallel_group == f"group{replica}", f"rank {rank}"
    assert orders[0] == orders[1], "every rank must call new_group in the same order"
    assert len(orders[0]) == 14, "4 groups per axis, 3 axes, and 2 model replicas (pp x tp)"


def test_process_mesh_refuses_a_world_of_another_size(monkeypatch):
    monkeypatch.setattr(topology, "dist", _FakeDist(world=4, rank=0))
    with pytest.raises(TopologyError, match="= 8 processes, but torch.distributed has 4"):
        ProcessMesh.create(Topology(dp=2, pp=2, tp=2))


def test_new_subgroup_sorts_dedups_and_checks_ranks(monkeypatch):
    fake = _FakeDist(world=8, rank=0)
    monkeypatch.setattr(topology, "dist", fake)
    assert new_subgroup([6, 0, 2, 4, 2]) == "group[0, 2, 4, 6]"
    with pytest.raises(TopologyError, match=r"ranks \[8\] are outside the world of size 8"):
        new_subgroup([0, 8])


def _group_timeouts() -> dict:
    import torch
    import torch.distributed as dist

    from shardwise.topology import world_timeout

    mesh = ProcessMesh.create(Topology.build(4, tp=2))
    out = {"world": world_timeout().total_seconds()}
    for axis in ("dp", "tp", "model_parallel"):
        group = mesh.groups[axis]
        backend = group._get_backend(torch.device("cpu"))
        out[axis] = (backend.options._timeout.total_seconds(), group.group_desc)
    dist.barrier()
    return out


def test_every_mesh_group_has_the_worlds_timeout_and_a_name():
    """A sub-group made without a timeout keeps torch's 30 minutes, whatever the world was given:
    a rank asleep in a data-parallel all-reduce of a DP2 x TP2 layout hung that long (issue 13)."""
    for rank, got in enumerate(run_distributed(_group_timeouts, 4)):
        world = got.pop("world")
        assert world < 1800, f"rank {rank}: the harness gives its world a short timeout: {world}"
        names = {"dp": "data", "tp": "tensor", "model_parallel": "model-parallel"}
        for axis, (timeout, name) in got.items():
            assert timeout == world, (
                f"rank {rank} {axis} group: timeout {timeout} s, world {world} s"
            )
            assert name == names[axis], f"rank {rank} {axis} group named {name!r}"


# dp, pp, tp, cp: the context axis sits between data and tensor (Megatron's tp-cp-dp-pp order)
CP_LAYOUTS = [(2, 1, 1, 2), (1, 1, 2, 2), (2, 2, 2, 2), (1, 1, 1, 4), (3, 1, 2, 2)]


@pytest.mark.parametrize("dp, pp, tp, cp", CP_LAYOUTS)
def test_the_context_axis_sits_between_data_and_tensor(dp, pp, tp, cp):
    topo = Topology(dp=dp, pp=pp, tp=tp, cp=cp)
    layout = f"dp={dp} pp={pp} tp={tp} cp={cp}"
    assert topo.world_size == dp * pp * tp * cp, layout
    for r in range(topo.world_size):
        c = topo.coord(r)
        assert topo.rank(pp=c.pp, dp=c.dp, tp=c.tp, cp=c.cp) == r, f"{layout} rank {r}"
        assert r == ((c.pp * dp + c.dp) * cp + c.cp) * tp + c.tp, f"{layout} rank {r}: order"
        assert topo.dp_cp_index(r) == c.dp * cp + c.cp, f"{layout} rank {r}"
    for axis in AXES:
        groups = topo.axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size)), layout
    # gradients average over the ranks holding the same parameters: same pp and tp
    replicas = topo.dp_cp_groups()
    assert sorted(r for g in replicas for r in g) == list(range(topo.world_size)), layout
    for g in replicas:
        assert len({(topo.coord(r).pp, topo.coord(r).tp) for r in g}) == 1, layout
        assert [topo.dp_cp_index(r) for r in g] == list(range(dp * cp)), layout


def test_process_mesh_makes_context_and_data_context_groups(monkeypatch):
    topo, orders = Topology(dp=2, tp=2, cp=2), []
    for rank in (0, 5):
        fake = _FakeDist(world=8, rank=rank)
        monkeypatch.setattr(topology, "dist", fake)
        mesh = ProcessMesh.create(topo)
        orders.append(fake.created)
        assert mesh.cp_group == f"group{topo.peers(rank, 'cp')}", f"rank {rank}"
        assert mesh.dp_cp_group == f"group{mesh.dp_cp_ranks()}", f"rank {rank}"
        assert mesh.dp_cp_rank == topo.dp_cp_index(rank), f"rank {rank}"
    assert orders[0] == orders[1], "every rank must call new_group in the same order"
    # 4 groups on each of dp, cp and tp, 8 one-rank pipeline groups, 4 model replicas
    # (dp x cp), 2 data-context groups (pp x tp)
    assert len(orders[0]) == 3 * 4 + 8 + 4 + 2, orders[0]
    assert topo.rank_table().splitlines()[1].split()[3:] == ["pp", "dp", "cp", "tp"]
