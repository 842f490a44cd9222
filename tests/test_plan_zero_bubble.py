"""shardwise plan enumerates the zero-bubble schedules and predicts their bubble and memory.

With communication and the update made free, a step is m micro-batch times plus the bubble,
so the planner's bubble share must be the schedule's: (p-1)(F+B-2W) micro-batch times for
ZB-H1 (F = 1/3 of a micro-batch without recompute; W the weight gradients' share, their
GEMMs as many FLOPs as the weighted products' forward: a little under F, attention's
products having no weight), 1F1B's p-1 unchanged, and whatever the library's simulator
finds for ZBV (less than ZB-H1's). Memory: a stage holds its
micro-batches from the forward to the W (schedule.peak_held); in a V, stage 0 holds the first
and the last layers, so the embedding, the head and the loss's activations.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.config import parse_config
from shardwise.parallel.pipeline.schedule import make_schedule, peak_held, simulate
from shardwise.plan import PRESETS, Dims, Layout, Planner, build, read_model
from shardwise.plan.candidates import candidates, to_config
from shardwise.plan.timing import micro_batch_time, split_shares

FREE = replace(
    PRESETS["a100-80g"], intra_gbps=1e12, inter_gbps=1e12, latency_us=0, optimizer_gbps=1e18
)


def _planner(layers=8, m=8):
    d = Dims(layers=layers, hidden=64, heads=4, vocab=512, seq=16)
    return Planner(read_model(build(d)), FREE, m, 16, "fp32")


def _shares(planner: Planner, lay: Layout) -> tuple[float, float]:
    """(F, W) of the slowest stage, the one the step time charges."""
    works = [planner.stage_view(lay, s).work for s in range(lay.pp)]
    slow = max(works, key=lambda w: micro_batch_time(w, lay, FREE, "fp32"))
    return split_shares(slow, lay, FREE, "fp32")


def test_candidates_enumerate_the_zero_bubble_schedules():
    shape = _planner(layers=4).shape  # 4 blocks + embedding and head layers
    lays = list(candidates(shape, 4, 8, 8))
    by_pp = {}
    for lay in lays:
        by_pp.setdefault(lay.pp, set()).add(lay.schedule)
    assert by_pp[1] == {"1f1b"}
    assert by_pp[2] == {"1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev"}
    for lay in lays:
        if lay.schedule == "dualpipev":
            assert lay.grad_accum >= 2 * lay.pp, lay
    assert "zbv" in Layout(1, 1, 2, 0, 1, 8, schedule="zbv").name()


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b_s(p, m):
    planner = _planner(m=m)
    ofob = planner.evaluate(Layout(1, 1, p, 0, 1, m))
    zb = planner.evaluate(Layout(1, 1, p, 0, 1, m, schedule="zb-h1"))
    assert ofob["bubble"] == pytest.approx((p - 1) / (m + p - 1))
    f, w = _shares(planner, Layout(1, 1, p, 0, 1, m, schedule="zb-h1"))
    assert f == pytest.approx(1 / 3, abs=1e-3) and 0.25 < w <= f, (f, w)
    units = (p - 1) * (1 - 2 * w)  # (p-1)(F+B-2W), F + B = 1
    assert zb["bubble"] == pytest.approx(units / (m + units), rel=1e-2)
    assert zb["step_time_s"] < ofob["step_time_s"]
    lay = Layout(1, 1, p, 0, 1, m, schedule="zb-h1")
    for s in range(p):  # from a forward to its W: 1F1B's p on stage 0, up to p on every stage
        assert planner.in_flight(lay, s) == peak_held(make_schedule("zb-h1", p, s, m)) <= p


def test_zbv_bubble_is_the_simulator_s_and_below_zb_h1_s():
    p, m = 2, 8
    planner = _planner(m=m)
    zbv = planner.evaluate(Layout(1, 1, p, 0, 1, m, schedule="zbv"))
    zb = planner.evaluate(Layout(1, 1, p, 0, 1, m, schedule="zb-h1"))
    assert zbv["feasible"], zbv["reason"]
    assert zbv["bubble"] < zb["bubble"]
    f, w = _shares(planner, Layout(1, 1, p, 0, 1, m, schedule="zbv"))
    progs = [make_schedule("zbv", p, s, m, chunks=2) for s in range(p)]
    units = simulate(progs, 2, f, 1 - f, w, "v") - m
    assert zbv["bubble"] == pytest.approx(units / (m + units), rel=1e-3)


def test_a_v_puts_the_first_and_the_last_layers_on_stage_0():
    planner = _planner(layers=4)
    lay = Layout(1, 1, 2, 0, 1, 8, schedule="zbv")
    first, last = planner.ranges(lay, 0), planner.ranges(lay, 1)
    n = len(planner.shape.layers)
    assert first[0][0] == 0 and first[1][1] == n  # virtual stages 0 and 3
    assert last[0][1] == last[1][0]  # virtual stages 1 and 2 meet on stage 1
    loop = Layout(1, 1, 2, 0, 1, 8)
    assert planner.model_states(lay, 0).params > planner.model_states(loop, 0).params
    assert planner.stage_view(lay, 0).loss_activations > 0
    assert planner.stage_view(lay, 1).loss_activations == 0


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev"])
def test_the_written_config_runs_the_schedule(schedule):
    cfg = parse_config(to_config(Layout(1, 1, 2, 0, 1, 8, schedule=schedule), "fp32"))
    assert cfg.pipeline.schedule == schedule
    assert cfg.pipeline.chunks == (2 if schedule in ("zbv", "dualpipev") else 1)


@pytest.mark.parametrize("rank", [0, 5])
def test_simulated_v_rank_holds_what_the_planner_predicts(capsys, rank):
    """--simulate runs initialize for one rank of a zbv layout in a fake world: the parameters
    and gradients it holds are the planner's prediction for its two chunks."""
    from shardwise.launch.cli import main

    flags = ["--arch", "llama", "--layers", "8", "--hidden", "256", "--heads", "8"]
    flags += ["--kv-heads", "8", "--ffn", "512", "--vocab", "1024", "--seq", "64"]
    flags += ["--nodes", "1", "--procs-per-node", "8", "--global-batch", "16", "--dp", "2"]
    flags += ["--pp", "4", "--zero-stage", "1", "--micro-batch", "1", "--schedule", "zbv"]
    assert main(["plan", *flags, "--simulate", str(rank)]) == 0
    out = capsys.readouterr().out
    assert "zbv" in out
    predicted, held = (line for line in out.splitlines() if "params" in line and "grads" in line)
    assert predicted.split("params ")[1].split(",")[0:3] == held.split("params ")[1].split(",")[0:3]
