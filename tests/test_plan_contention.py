"""A pipeline on ranks that share cores (plan/contention.py): the schedule run against one clock.

Specification, each a table over the library's schedules:
- with a core per rank the run is the library's own schedule simulator (bubble.bubble_units:
  m + bubble micro-batch times), whatever the schedule;
- with fewer cores than ranks, the work of the stages busy at a moment shares the cores:
  one micro-batch through 2 stages of 2 ranks on 2 cores runs at full speed (one stage busy
  at a time), the same step on 1 core at half; on saturated cores a schedule that fills its
  bubble (ZB-H1, ZBV, interleaved) is no faster than 1F1B (the cores are the limit: all the
  ranks' work / the cores), with a core each it is;
- a wait (on-path communication) holds no core, a message's hop delays its receiver only.
"""

from __future__ import annotations

import pytest

from shardwise.plan.bubble import bubble_units
from shardwise.plan.contention import StageCost, contended

F, B, W = 1 / 3, 2 / 3, 1 / 3
UNIFORM = StageCost(F, B, W, 0.0)
SCHEDULES = [  # (schedule, stages, micro-batches)
    ("gpipe", 2, 4),
    ("1f1b", 2, 4),
    ("1f1b", 4, 8),
    ("zb-h1", 2, 4),
    ("zb-h1", 4, 8),
    ("zbv", 2, 4),
    ("dualpipev", 2, 4),
    ("interleaved", 2, 4),
]
IDS = [f"{s} p{p} m{m}" for s, p, m in SCHEDULES]


@pytest.mark.parametrize("name,p,m", SCHEDULES, ids=IDS)
def test_a_core_each_is_the_library_simulator(name, p, m):
    run = contended(name, m, [UNIFORM] * p, ranks=2, cores=0, procs_per_node=2 * p)
    want = m + bubble_units(name, p, m, F, W)
    assert run.makespan == pytest.approx(want, rel=1e-9), f"{name} p{p} m{m}"
    assert run.busy == pytest.approx([m * (F + B)] * p), f"{name} p{p} m{m}: busy"


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("cores,speed", [(2, 1.0), (1, 0.5)])
def test_one_micro_batch_runs_one_stage_at_a_time(name, cores, speed):
    """2 stages of 2 ranks, one micro-batch: F0, F1, B1, B0 in turn, each at the speed of 2
    ranks on ``cores`` cores (ZB-H1's W only reorders the same work)."""
    run = contended(name, 1, [UNIFORM] * 2, ranks=2, cores=cores, procs_per_node=4)
    case = f"{name}, 4 ranks on {cores} cores"
    assert run.makespan == pytest.approx(2 * (F + B) / speed, rel=1e-9), case


@pytest.mark.parametrize("name", ["zb-h1", "zbv", "interleaved", "dualpipev"])
def test_filling_the_bubble_saves_nothing_on_saturated_cores(name):
    """4 ranks in 2 stages: with a core each the schedule beats 1F1B; on 2 cores both take
    what the cores allow, every rank's work / 2 cores (within the fill's lent time)."""
    m = 8
    for cores in (4, 2):
        t = {s: contended(s, m, [UNIFORM] * 2, 2, cores, 4).makespan for s in ("1f1b", name)}
        case = f"{name} vs 1f1b on {cores} cores: {t}"
        if cores == 4:
            assert t[name] < t["1f1b"], case
        else:
            floor = 4 * m * (F + B) / cores
            assert floor * (1 - 1e-9) <= t[name] <= t["1f1b"] * (1 + 1e-9), case
            assert t[name] == pytest.approx(t["1f1b"], rel=0.05), case


def test_a_wait_holds_no_core_and_a_hop_delays_the_receiver():
    """One micro-batch, 2 stages of 2 ranks on 2 cores: a wait adds its time to its stage
    (no core is needed to wait), a hop the time each of the 2 messages takes."""
    base = contended("1f1b", 1, [UNIFORM] * 2, 2, 2, 4).makespan
    waiting = contended("1f1b", 1, [StageCost(F, B, W, 0.3)] * 2, 2, 2, 4)
    assert waiting.makespan == pytest.approx(base + 2 * 0.3, rel=1e-9), "waits"
    assert waiting.waited == pytest.approx([0.3, 0.3]), "waited per stage"
    hopping = contended("1f1b", 1, [StageCost(F, B, W, 0.0, hop=0.1)] * 2, 2, 2, 4)
    assert hopping.makespan == pytest.approx(base + 2 * 0.1, rel=1e-9), "hops"


def test_the_record_is_the_run():
    """Each compute instruction once, its work before its wait, no overlap on a stage."""
    done: list = []
    run = contended("1f1b", 4, [StageCost(F, B, W, 0.05)] * 2, 2, 2, 4, done)
    assert len(done) == 2 * 2 * 4, "F and B of 4 micro-batches on 2 stages"
    for s in range(2):
        mine = sorted((a, cut, b) for st, a, cut, b, _ in done if st == s)
        assert all(a <= cut <= b for a, cut, b in mine), f"stage {s}: work then wait"
        assert all(x[2] <= y[0] + 1e-12 for x, y in zip(mine, mine[1:], strict=False)), (
            f"stage {s}: overlap"
        )
        assert mine[-1][2] == pytest.approx(run.finish[s]), f"stage {s}: finish"


@pytest.mark.parametrize("m", [1, 8])
def test_stages_on_other_nodes_lend_nothing(m):
    """2 stages of 4 ranks, a node of 4 ranks and 2 cores each: every stage runs at half
    speed whenever it works, the other stage's idle cores being on another node: twice the
    schedule's time with a device each."""
    run = contended("1f1b", m, [UNIFORM] * 2, ranks=4, cores=2, procs_per_node=4)
    alone = contended("1f1b", m, [UNIFORM] * 2, ranks=4, cores=0, procs_per_node=4)
    assert run.makespan == pytest.approx(2 * alone.makespan, rel=1e-9), f"m {m}"
