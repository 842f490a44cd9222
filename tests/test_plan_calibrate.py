"""``shardwise plan --calibrate``: the fits, a real (tiny) measurement, the preset it saves."""

from __future__ import annotations

import json

import pytest

from shardwise.launch.cli import main
from shardwise.plan import (
    Cluster,
    Dims,
    Layout,
    Planner,
    build,
    calibrate,
    calibrate_fits,
    read_model,
)
from shardwise.plan.calibrate_ops import OPS, RING
from shardwise.plan.cluster import load
from shardwise.plan.contention import contended
from shardwise.plan.timing import (
    CALL_WAIT,
    ON_PATH,
    StageWork,
    compute_time,
    data_time,
    end_time,
    micro_batch_time,
    optimizer_time,
    stage_cost,
    step_time,
)

GPT_FLAGS = ["--arch", "gpt", "--layers", "2", "--hidden", "64", "--heads", "2"]
GPT_FLAGS += ["--vocab", "64", "--seq", "32", "--global-batch", "4", "--procs-per-node", "2"]
SIZES = (1 << 10, 1 << 16)


@pytest.mark.parametrize("latency,bandwidth", [(50e-6, 1e9), (1e-3, 2e8), (0.0, 5e9)])
def test_fit_recovers_latency_and_bandwidth(latency, bandwidth):
    xs = [1e3, 1e4, 1e5, 1e6, 1e7]
    ts = [latency + x / bandwidth for x in xs]
    a, bw = calibrate.fit_line(xs, ts)
    case = f"latency {latency}, bandwidth {bandwidth:g}"
    assert a == pytest.approx(latency, abs=1e-9), case
    assert bw == pytest.approx(bandwidth, rel=1e-6), case


def test_fit_keeps_a_physical_line_on_noise():
    """Times that fall with size (noise on a busy machine) give no negative speed."""
    a, bw = calibrate.fit_line([1e3, 1e6], [2e-3, 1e-3])
    assert a >= 0 and bw > 0, (a, bw)
    a, bw = calibrate.fit_line([1e3, 1e6], [1e-6, 1e-3])  # a negative intercept, clamped
    assert a == 0 and bw == pytest.approx(1e9, rel=1e-3), (a, bw)


def _rank(rate: float, coll: dict, tp_blocks: list | None = None, cp: list | None = None) -> dict:
    """A rank's synthetic measurements: GEMMs at ``rate`` FLOP/s, blocks at half of it after
    a fixed 1 ms, the update 30 us a tensor and 4 GB/s."""
    blocks = [(flops, 1e-3 + flops / (rate / 2)) for flops in (1e9, 1e3)]
    return {"compute": {"fp32": rate, "bf16": rate / 2}, "blocks": blocks, "optimizer": (30e-6, 4e9),
            "collectives": coll, "tp_blocks": tp_blocks or [], "cp": cp or [],
            "split": 4e-4}  # fmt: skip


def _cp_attention(per_call_s: dict, excess: dict, rate: float) -> list[dict]:
    """Context-split attention of two sizes on 2 ranks, each as the planner charges it (3 x 2
    x F / ``rate``; ring: 4 (n-1) + 2 n sends, Ulysses: 8 all-to-alls, at 100 us + ring
    bytes / 1 GB/s) plus ``per_call_s`` and the arithmetic ``excess`` of each method."""
    out = []
    for flops, payload in ((4e7, 1 << 16), (2e6, 1 << 13)):
        arith = 3 * 2 * flops / rate
        comm = {"ring": 8 * (100e-6 + payload / 1e9), "ulysses": 8 * (100e-6 + payload / 2e9)}
        times = {m: arith * (1 + excess[m]) + comm[m] + per_call_s[m] for m in comm}
        out.append({"flops": flops, "payload": payload, **times})
    return out


def _tp_blocks(per_call_s: float, excess: float) -> list[dict]:
    """Split blocks of two sizes, each as the model predicts it (1 ms fixed, the rest halved,
    4 all-reduces at 100 us + 2 (n-1)/n bytes / 1 GB/s), plus ``per_call_s`` per all-reduce
    and the halved arithmetic ``excess`` slower."""
    out = []
    for full, payload in ((0.021, 1 << 20), (0.005, 1 << 17)):
        call = 100e-6 + payload / 1e9
        split = (full - 1e-3) / 2
        tp = split * (1 + excess) + 1e-3 + 4 * (call + per_call_s)
        out.append({"full": full, "tp": tp, "calls": 4, "payload": payload})
    return out


def test_summary_is_a_preset_whose_times_are_the_fit(monkeypatch):
    """Synthetic ranks: each collective takes 100 us + ring bytes / 1 GB/s; the slower rank
    sets each time; the preset's collective_time gives back the line."""
    monkeypatch.setattr(calibrate, "cores", lambda: 4)  # a rank per core: no turns taken
    monkeypatch.setattr(calibrate_fits, "cores", lambda: 4)
    ring = {op: RING[op](2) for op in OPS}
    fast = {op: [100e-6 + ring[op] * s / 1e9 for s in SIZES] for op in OPS}
    slow = {op: [t * 1.0 for t in ts] for op, ts in fast.items()}
    tp = _tp_blocks(300e-6, 0.25)
    cp = _cp_attention({"ring": 2e-3, "ulysses": 1e-3}, {"ring": 0.5, "ulysses": 0.0}, 1.5e10)
    preset = calibrate.summarize({1: [_rank(4e10, {})], 2: [_rank(4e10, fast, tp, cp),
                                                            _rank(3e10, slow, tp, cp)]},
                                 SIZES)  # fmt: skip
    machine = Cluster(**preset)
    assert machine.compute["fp32"] == pytest.approx({"1": 0.02, "2": 0.015}), "slowest block"
    assert machine.fp32_tflops == pytest.approx(0.04), "the peak: a GEMM's rate"
    assert machine.cores == 4
    assert machine.layer_overhead_us == pytest.approx(1000.0), "the blocks' fixed cost"
    assert machine.layer_overheads_us == pytest.approx({"1": 1000.0, "2": 1000.0}), "per world"
    assert machine.split_overhead_us == pytest.approx(400.0), "the split backward's cost"
    assert machine.optimizer_tensor_us == pytest.approx(30.0), "the update's cost per tensor"
    assert machine.optimizer_gbps == pytest.approx(4.0), "the update's bytes per second"
    for op in OPS:
        t = machine.collective_time(op, 1 << 20, 2, inter=False)
        assert t == pytest.approx(100e-6 + ring[op] * (1 << 20) / 1e9, rel=1e-6), op
    two = Cluster(**{**preset, "procs_per_node": 2, "cores": 2})
    assert two.tflops("fp32") == pytest.approx(0.015), "2 ranks: the slower one's block"
    # The split blocks cost 300 us per all-reduce and a quarter more arithmetic than half the
    # whole: the fit finds both, exactly.
    assert machine.tp_call_us == pytest.approx({"2": 300.0}), "tensor-parallel call cost"
    assert machine.tp_compute == pytest.approx({"2": 0.25}), "split arithmetic's excess"
    assert machine.fit_errors["tp_block"]["2"] == pytest.approx(0.0, abs=1e-9)
    # Context-split attention: 2 ms / 1 ms per call beyond its messages, the ring's
    # arithmetic half as slow again as the block rate (1.5e10 FLOP/s at 2 ranks).
    for method, us, k in (("ring", 2000.0, 0.5), ("ulysses", 1000.0, 0.0)):
        assert machine.cp_call_us[method] == pytest.approx({"2": us}), method
        assert machine.cp_compute[method] == pytest.approx({"2": k}, abs=1e-9), method
        assert machine.fit_errors[f"cp_{method}"]["2"] == pytest.approx(0.0, abs=1e-9), method
    assert all(e == pytest.approx(0.0, abs=1e-9) for e in machine.fit_errors["all_reduce"].values())


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallelism_pays_the_calibrated_costs(sequence_parallel):
    """Each tensor-parallel collective on the path costs tp_call_us more, and the split
    arithmetic 1 + tp_compute times as long; nothing else changes."""
    base = Cluster("m", procs_per_node=2, cores=2, latency_us=0.0)
    taxed = Cluster(
        "m", procs_per_node=2, cores=2, latency_us=0.0, tp_call_us={"2": 500.0},
        tp_compute={"2": 0.25},
    )  # fmt: skip
    model = read_model(build(Dims(layers=1, hidden=32, heads=2, vocab=32, seq=8)))
    lay = Layout(1, 2, 1, 0, 1, 1, sequence_parallel=sequence_parallel)
    plain, more = (Planner(model, m, 1, 8, "fp32").stage_view(lay, 0) for m in (base, taxed))
    calls = sum(c.count for c in plain.calls if c.axis == "tensor")
    arithmetic = 3 * plain.work.flops / (base.tflops("fp32") * 1e12)
    a = step_time([plain.work], lay, base, "fp32").total
    b = step_time([more.work], lay, taxed, "fp32").total
    case = f"sp={sequence_parallel}, {calls} tensor calls"
    assert b - a == pytest.approx(calls * 500e-6 + 0.25 * arithmetic, rel=1e-9), case


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("procs,share", [(2, 1), (4, 2)])
def test_context_parallelism_pays_the_calibrated_costs(method, procs, share):
    """Each context-split attention call costs cp_call_us more (x the ranks sharing a core:
    it is work, done in turns) and its arithmetic (3 cp F / rate) cp_compute more; nothing
    else changes. Two layers: two calls."""
    base = Cluster("m", procs_per_node=procs, cores=2, latency_us=0.0)
    taxed = Cluster(
        "m", procs_per_node=procs, cores=2, latency_us=0.0, cp_call_us={method: {"2": 700.0}},
        cp_compute={method: {"2": 0.5}},
    )  # fmt: skip
    model = read_model(build(Dims(layers=2, hidden=32, heads=2, vocab=32, seq=8)))
    lay = Layout(procs // 2, 1, 1, 0, 2, 1, cp=2, cp_method=method)
    plain, more = (Planner(model, m, 1, 2, "fp32").stage_view(lay, 0) for m in (base, taxed))
    case = f"{method} on {procs} ranks, 2 cores"
    assert plain.work.attention_calls == 2, f"{case}: one call per layer"
    arithmetic = 3 * 2 * plain.work.attention_flops / (base.tflops("fp32") * 1e12)
    a = step_time([plain.work], lay, base, "fp32").total
    b = step_time([more.work], lay, taxed, "fp32").total
    assert b - a == pytest.approx(2 * 700e-6 * share + 0.5 * arithmetic, rel=1e-9), case
    assert arithmetic > 0, f"{case}: the traced attention has FLOPs"


def test_real_calibration_with_two_processes(tmp_path):
    """A tiny run over gloo (two sizes, small GEMMs): every op fitted for a group of 2, and
    the saved preset plans a model (no assertion on speed: this machine is shared)."""
    data = calibrate.measure([2], sizes=SIZES, repeats=2, gemm=(64, 32), quiet_s=0)
    assert set(data["collectives"]) == set(OPS)
    for op, fits in data["collectives"].items():
        lat, bw = fits["2"]
        assert lat >= 0 and bw > 0, (op, lat, bw)
    assert data["compute"]["fp32"]["2"] > 0 and data["layer_overhead_us"] >= 0
    assert data["tp_call_us"]["2"] >= 0 and data["tp_compute"]["2"] >= 0, "split block fitted"
    assert data["split_overhead_us"] >= 0, "the B/W split timed"
    for method in ("ring", "ulysses"):
        assert data["cp_call_us"][method]["2"] >= 0, f"context attention ({method}) fitted"
    assert set(data["fit_errors"]) == {*OPS, "tp_block", "cp_ring", "cp_ulysses"}, (
        "every fit reports its error"
    )
    path = calibrate.save(data, tmp_path / "calib.json")
    assert load(str(path)) == Cluster(**data), "the saved preset loads back unchanged"


def test_saved_preset_round_trips_through_the_cli(tmp_path, capsys):
    preset = calibrate.summarize({1: [_rank(4e10, {})]}, SIZES)
    path = calibrate.save(preset, tmp_path / "sub" / "mine.json")
    assert json.loads(path.read_text()) == preset
    assert load(str(path)) == Cluster(**preset)
    assert main(["plan", *GPT_FLAGS, "--cluster", str(path), "--json"]) == 0
    recs = json.loads(capsys.readouterr().out)
    assert recs and all(r["step_time_s"] > 0 for r in recs if r["feasible"])


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--calibrate", "--calibrate-procs", "2,x"], "--calibrate-procs '2,x'"),
        (["--calibrate", "--calibrate-procs", "0"], "--calibrate-procs [0]"),
        (["--calibrate", "--output", "{tmp}"], "is a directory"),
        (["--calibrate", "--output", "{tmp}/calib.txt"], "give a .json file"),
        ([*GPT_FLAGS, "--cluster", "{tmp}/none.json"], "no such preset or file"),
        ([*GPT_FLAGS, "--cluster", "{tmp}/bad.json"], "write one with `shardwise plan --calibrate"),
    ],
)
def test_bad_calibration_flags_name_the_flag(tmp_path, capsys, flags, message):
    (tmp_path / "bad.json").write_text(json.dumps({"name": "x", "gpus": 8}))
    argv = ["plan", *(f.format(tmp=tmp_path) for f in flags)]
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert message in err and flags[-2] in err, (argv, err)


def _compute_s(shape, ppn: int, cores: int, mb: int) -> float:
    preset = calibrate.summarize({1: [_rank(4e10, {})]}, SIZES)
    machine = Cluster(**{**preset, "layer_overheads_us": {"1": 1000.0}, "layer_ops": 0.0, "cores": cores,
                         "procs_per_node": ppn, "optimizer_gbps": 1e12,
                         "optimizer_tensor_us": 0.0})  # fmt: skip
    lay = Layout(ppn, 1, 1, 0, mb, 8 // ppn // mb)
    return Planner(shape, machine, 8, 32, "fp32").evaluate(lay)["time"]["compute"]


def test_fixed_layer_cost_favours_fewer_larger_micro_batches():
    """With a calibrated fixed cost per layer and pass, 4 micro-batches of 1 pay it 4 times
    where one of 4 pays it once; 4 ranks time-sharing 2 cores pay it twice as long (the
    optimizer made free, so only the layers' costs differ)."""
    shape = read_model(build(Dims(layers=2, hidden=64, heads=2, vocab=64, seq=32)))
    fixed = len(shape.layers) * 1e-3
    small, large = _compute_s(shape, 2, 2, 1), _compute_s(shape, 2, 2, 4)
    assert small - large == pytest.approx(3 * fixed, rel=1e-6), "dp2: mb 1x4 against 4x1"
    shared, own = _compute_s(shape, 4, 2, 1), _compute_s(shape, 4, 4, 1)
    assert shared - own == pytest.approx(2 * fixed, rel=1e-6), "dp4 mb 1x2: 2 or 4 cores"


def test_layer_cost_is_the_fit_of_the_ranks_that_share_the_cores():
    """One rank alone pays 1 ms per layer, two busy at once 1.5 ms each: a plan of 2 or more
    ranks on 2 cores takes the 2-rank fit (4 ranks then take turns: x share elsewhere)."""
    coll = {op: [100e-6 + RING[op](2) * b / 1e9 for b in SIZES] for op in OPS}
    two = [_rank(4e10, coll, _tp_blocks(0.0, 0.0)) for _ in range(2)]
    worlds = {1: [_rank(4e10, {})], 2: two}
    for r in two:
        r["blocks"] = [(f, t + 0.5e-3) for f, t in r["blocks"]]
    preset = calibrate.summarize(worlds, SIZES)
    assert preset["layer_overheads_us"] == pytest.approx({"1": 1000.0, "2": 1500.0})
    for ppn, want in ((1, 1e-3), (2, 1.5e-3), (4, 1.5e-3)):
        machine = Cluster(**{**preset, "cores": 2, "procs_per_node": ppn})
        assert machine.layer_cost_s() == pytest.approx(want), f"{ppn} ranks on 2 cores"
    assert Cluster("gpu", layer_overhead_us=20.0).layer_cost_s() == pytest.approx(20e-6)


SMALL = Dims(layers=4, hidden=32, heads=2, vocab=32, seq=8)


@pytest.mark.parametrize("cores,tp", [(2, 2), (4, 2), (2, 1)])
def test_a_blocking_call_waits_its_calibrated_time_whatever_the_sharing(cores, tp):
    """Without a pipeline, each blocking collective (tensor, data, the step's scalars; not a
    message) costs its calibrated per-core wait on top of its ring fit, on the path or as
    data-parallel traffic (hidden by ``overlap``) whatever the ranks per core."""
    lay = Layout(4 // tp, tp, 1, 0, 1, 4)
    m = Cluster("m", procs_per_node=4, cores=cores, latency_us=0.0, tp_call_us={"2": 500.0})
    bare = Cluster("m", procs_per_node=4, cores=cores, latency_us=0.0)
    works = [Planner(read_model(build(SMALL)), m, 8, 8, "fp32").stage_view(lay, 0).work]
    calls = [c for c in works[0].calls if c.axis in CALL_WAIT and c.op not in ("send", "recv")]
    on_path = sum(c.count for c in calls if c.axis in ON_PATH)
    data = sum(c.count for c in calls if c.axis not in ON_PATH)
    want = (on_path + (1 - m.overlap) * data) * 500e-6
    got = (
        step_time(works, lay, m, "fp32").exposed_comm
        - step_time(works, lay, bare, "fp32").exposed_comm
    )
    assert data, "the layout reduces gradients"
    assert got == pytest.approx(want, rel=1e-6), f"4 ranks on {cores} cores, tp {tp}"


@pytest.mark.parametrize("cores,tp", [(2, 1), (2, 2), (1, 1)])
def test_a_pipeline_on_shared_cores_is_its_run_in_time(cores, tp):
    """4 ranks in 2 stages on fewer cores: the step is contention.py's run of the schedule
    with each stage's costs, then the step's end calls, the data-parallel traffic and the
    update of the stage that ends last; its parts add up to it."""
    lay = Layout(2 // tp, tp, 2, 0, 1, 4)
    m = Cluster("m", procs_per_node=4, cores=cores, latency_us=0.0, tp_call_us={"2": 500.0})
    planner = Planner(read_model(build(SMALL)), m, 8, 8, "fp32")
    views = [planner.stage_view(lay, s) for s in range(2)]
    costs = [stage_cost(v.work, lay, m, "fp32") for v in views]
    run = contended(lay.schedule, 4, costs, 2, cores, 4)
    last = max(range(2), key=lambda i: run.finish[i])
    w = views[last].work
    tail = end_time(w, lay, m) + (1 - m.overlap) * data_time(w, lay, m)
    tail += optimizer_time(w.states, lay, m)
    t = step_time([v.work for v in views], lay, m, "fp32")
    case = f"4 ranks on {cores} cores, tp {tp}"
    assert t.total == pytest.approx(run.makespan + tail, rel=1e-9), case
    assert t.bubble == pytest.approx(run.makespan - run.busy[last] - run.waited[last]), case
    assert costs[0].hop > 500e-6, f"{case}: a message pays a call's wait"


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "interleaved"])
def test_a_schedule_that_fills_its_bubble_saves_nothing_on_shared_cores(schedule):
    """4 ranks, 2 stages: with a core each, the schedule's own (smaller) bubble makes the
    step shorter than 1F1B's; on 2 cores the cores are the limit: what it saves there is
    at most its stages' balance (a V's placement), under 5% and under what it saves with a
    core each."""
    model = read_model(build(SMALL))
    gain = {}
    for cores in (4, 2):
        m = Cluster("m", procs_per_node=4, cores=cores, latency_us=0.0)
        planner = Planner(model, m, 8, 8, "fp32")
        got = {
            s: planner.evaluate(Layout(2, 1, 2, 0, 1, 4, schedule=s)) for s in ("1f1b", schedule)
        }
        gain[cores] = 1 - got[schedule]["step_time_s"] / got["1f1b"]["step_time_s"]
    assert gain[4] > 0.01, f"{schedule} with a core each: {gain}"
    assert gain[2] < min(gain[4], 0.05), f"{schedule} on 2 cores: {gain}"


@pytest.mark.parametrize("schedule,split", [("zb-h1", 1.0), ("zbv", 1.0), ("1f1b", 0.0)])
@pytest.mark.parametrize("cores", [4, 2])
def test_a_split_backward_pays_its_calibrated_cost(schedule, split, cores):
    """A schedule whose backwards run as B and W pays split_overhead_us per layer and
    micro-batch: with a core each exactly; on shared cores as work done in turns (between
    once and x share of it, as the stages' overlap decides); 1F1B never splits."""
    model = read_model(build(SMALL))
    lay = Layout(2, 1, 2, 0, 1, 4, schedule=schedule)
    base = Cluster("m", procs_per_node=4, cores=cores, latency_us=0.0)
    taxed = Cluster("m", procs_per_node=4, cores=cores, latency_us=0.0, split_overhead_us=500.0)
    t = {}
    for name, m in (("base", base), ("taxed", taxed)):
        works = [Planner(model, m, 8, 8, "fp32").stage_view(lay, s).work for s in range(2)]
        t[name] = step_time(works, lay, m, "fp32")
    layers = works[0].layers
    once = 4 * split * layers * 500e-6
    case = f"{schedule} on {cores} cores, {layers} layers a stage"
    if base.share() == 1:
        assert t["taxed"].compute - t["base"].compute == pytest.approx(once, abs=1e-12), case
    else:
        grew = t["taxed"].total - t["base"].total
        assert once * (1 - 1e-9) <= grew <= once * base.share() * (1 + 1e-9), case


@pytest.mark.parametrize("ops,recompute_ops,units", [(88, 0, 2.0), (44, 44, 4 / 3), (0, 0, 3.0)])
def test_a_layer_costs_its_ops_in_calibration_blocks(ops, recompute_ops, units):
    """The calibrated block (44 forward ops, 1 ms fixed) sets a per-op cost: 3 layers of 88
    ops in all cost 2 ms, a checkpointed one of 44 again a third more; without an op count
    (0: a model not traced) each of the 3 layers costs one block's 1 ms."""
    machine = Cluster("m", layer_overhead_us=1000.0, layer_ops=44.0, peak_tflops=1e9)
    work = StageWork(0.0, 0.0, [], None, 3, 1 if recompute_ops else 0, ops, recompute_ops)
    case = f"{ops} ops, {recompute_ops} recomputed"
    assert compute_time(work, machine, "bf16") == pytest.approx(units * 1e-3, rel=1e-9), case


def test_the_split_backward_s_cost_grows_with_its_linears():
    """Timed at two sizes, the split's cost is fitted as a fixed part per block and a part
    per weighted FLOP (300 us + FLOPs / 1e9), and a zero-bubble pipeline pays both per
    layer and split backward: layers x 300 us + the stage's weighted FLOPs / 1e9."""
    pts = [
        (24.0 * 64, 300e-6 + 24.0 * 64 / 1e9),
        (24.0 * 512 * 128**2, 300e-6 + 24.0 * 512 * 128**2 / 1e9),
    ]
    fit = calibrate.split_fit([pts, pts])
    assert fit["split_overhead_us"] == pytest.approx(300.0, rel=1e-6), fit
    assert fit["split_flops_rate"] == pytest.approx(1e9, rel=1e-6), fit
    assert calibrate.split_fit([4e-4, 4e-4]) == {"split_overhead_us": pytest.approx(400.0)}
    model = read_model(build(SMALL))
    lay = Layout(1, 1, 2, 0, 1, 4, schedule="zb-h1")
    base = Cluster("m", procs_per_node=2, cores=2, latency_us=0.0)
    taxed = Cluster("m", procs_per_node=2, cores=2, latency_us=0.0, **fit)
    works = {
        n: [Planner(model, m, 8, 8, "fp32").stage_view(lay, s).work for s in range(2)]
        for n, m in (("base", base), ("taxed", taxed))
    }
    t = {
        n: step_time(w, lay, m, "fp32")
        for (n, w), m in zip(works.items(), (base, taxed), strict=True)
    }
    w = max(works["taxed"], key=lambda x: micro_batch_time(x, lay, taxed, "fp32"))  # charged
    want = 4 * (w.layers * 300e-6 + w.weight_flops / 1e9)
    assert w.weight_flops > 0, "the stage's linears counted"
    assert t["taxed"].compute - t["base"].compute == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_the_update_pays_its_calibrated_cost_per_tensor(zero_stage):
    """The update costs its bytes / optimizer_gbps plus optimizer_tensor_us per tensor it
    steps: each trainable parameter without ZeRO, each flat master (a bucket, a unit) with
    it; ranks sharing cores take turns (x share: 4 ranks on 2 cores)."""
    model = read_model(build(SMALL))
    lay = Layout(4, 1, 1, zero_stage, 1, 1)
    base = Cluster("m", procs_per_node=4, cores=2, optimizer_gbps=4.0)
    taxed = Cluster("m", procs_per_node=4, cores=2, optimizer_gbps=4.0, optimizer_tensor_us=30.0)
    states = Planner(model, base, 4, 4, "fp32").stage_view(lay, 0).work.states
    trainable = sum(1 for p in model.params if p.trainable)
    if zero_stage == 0:
        assert states.tensors == trainable, "without ZeRO: every trainable parameter"
    else:
        assert 0 < states.tensors < trainable, f"ZeRO-{zero_stage}: a master per bucket or unit"
    extra = optimizer_time(states, lay, taxed) - optimizer_time(states, lay, base)
    assert extra == pytest.approx(states.tensors * 30e-6 * 2, rel=1e-9), f"ZeRO-{zero_stage}"


def test_the_tp_block_s_call_cost_is_the_all_reduce_s_wait_between_segments():
    """Timed between compute segments, an all-reduce adds 2 ms beyond its fitted transfer:
    the preset's per-call cost is that (per core: 2 ranks on 4 cores), the split TP block's
    arithmetic excess fitted alone (exactly), and every kind of call waits it."""
    ring = {op: RING[op](2) for op in OPS}
    coll = {op: [100e-6 + ring[op] * s / 1e9 for s in SIZES] for op in OPS}
    size = 1 << 14
    timed = {"size": size, "seconds": 2e-3 + 100e-6 + ring["all_reduce"] * size / 1e9}
    rank = _rank(4e10, coll, _tp_blocks(2e-3, 0.25)) | {"call_excess": timed}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibrate, "cores", lambda: 4)
        mp.setattr(calibrate_fits, "cores", lambda: 4)
        machine = Cluster(**calibrate.summarize({1: [_rank(4e10, {})], 2: [rank, rank]}, SIZES))
    assert machine.tp_call_us == pytest.approx({"2": 2000.0}, rel=1e-6), "the all-reduce's"
    assert machine.tp_compute == pytest.approx({"2": 0.25}, rel=1e-6), "k fitted alone"
    assert machine.fit_errors["tp_block"]["2"] == pytest.approx(0.0, abs=1e-9)
    assert machine.call_wait(2) == pytest.approx(2e-3, rel=1e-6)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_step_pays_its_ranks_calibrated_start_skew(pp):
    """Ranks leaving a barrier 3 ms apart (calibrated at 4 processes): a step of 4 ranks
    counts 3 ms more from its first rank's start, pipelines on shared cores too; 2 ranks
    take the nearest calibrated count's."""
    model = read_model(build(SMALL))
    base = Cluster("m", procs_per_node=4, cores=2, latency_us=0.0)
    skewed = Cluster("m", procs_per_node=4, cores=2, latency_us=0.0, start_skew_us={"4": 3000.0})
    lay = Layout(4 // pp, 1, pp, 0, 1, 2)
    got = {
        name: Planner(model, m, 8, 8, "fp32").evaluate(lay)["step_time_s"]
        for name, m in (("base", base), ("skewed", skewed))
    }
    assert got["skewed"] - got["base"] == pytest.approx(3e-3, rel=1e-6), f"pp{pp}: {got}"
    assert skewed.start_skew(2) == pytest.approx(3e-3) and skewed.start_skew(1) == 0.0


def test_a_calibration_on_busy_cores_says_so_before_measuring(monkeypatch):
    """Cores still 90% busy after the wait: the calibration warns, naming the fix, then
    measures (the warning comes before the first world is started)."""
    waited = []
    monkeypatch.setattr(calibrate, "wait_quiet", lambda limit: waited.append(limit) or 0.9)

    def started(*args, **kwargs):
        raise RuntimeError("first world started")

    monkeypatch.setattr(calibrate, "run_world", started)
    with pytest.warns(UserWarning, match="90% busy.*idle machine"):
        with pytest.raises(RuntimeError, match="first world started"):
            calibrate.measure([2], quiet_s=5.0)
    assert waited == [5.0], "waits up to quiet_s for idle cores first"
