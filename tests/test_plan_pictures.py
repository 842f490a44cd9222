"""``shardwise plan --plot`` and ``--timeline`` (issue 31): the numbers drawn are the records'.

The data functions are checked against the records (memory by kind and the limit, the time
split; the timeline's segments against the step-time model: the slowest stage ends at the
record's step_time_s, each stage's busy time is its micro-batches' forward + backward, no two
segments of a row overlap, every micro-batch is drawn), and the files are PNGs.
"""

from __future__ import annotations

import pytest

from shardwise.launch.cli import main
from shardwise.plan import PRESETS, Cluster, Dims, Layout, Planner, build, read_model
from shardwise.plan.cluster import GIB
from shardwise.plan.pictures import MEMORY_KINDS, plot_data, timeline_data

PNG = b"\x89PNG\r\n\x1a\n"
GPT = Dims(layers=4, hidden=64, heads=4, vocab=64, seq=32)
PLANNER = Planner(read_model(build(GPT)), PRESETS["a100-80g"], 8, GPT.seq, "fp32")
# (name, layout): one without a pipeline, schedules with and without a split backward
TIMELINES = [
    ("dp", Layout(1, 1, 1, 0, 2, 4)),
    ("1f1b", Layout(1, 1, 2, 0, 1, 8)),
    ("gpipe ckpt", Layout(1, 1, 2, 0, 1, 8, True, schedule="gpipe")),
    ("zb-h1", Layout(1, 1, 4, 0, 1, 8, schedule="zb-h1")),
    ("zbv", Layout(1, 1, 2, 0, 1, 8, schedule="zbv")),
    ("interleaved", Layout(1, 1, 2, 0, 1, 8, schedule="interleaved")),
]


def test_plot_data_are_the_records():
    recs = PLANNER.plan([lay for _, lay in TIMELINES])
    data = plot_data(recs, 80 * GIB, top=3)
    assert data["limit_gib"] == 80 and len(data["names"]) == 3
    for i, r in enumerate(recs[:3]):
        for kind in MEMORY_KINDS:
            assert data["memory_gib"][kind][i] * GIB == pytest.approx(r["memory"][kind]), kind
        for kind, value in r["time"].items():
            assert data["time_s"][kind][i] == value, kind


@pytest.mark.parametrize("name,layout", TIMELINES, ids=[t[0] for t in TIMELINES])
def test_timeline_is_the_step_time_model(name, layout):
    rec = PLANNER.evaluate(layout)
    data = timeline_data(PLANNER, layout)
    slow = max(s[2] for s in data["rows"][data["slow"]]["segments"])
    assert slow == pytest.approx(rec["step_time_s"], rel=1e-9), name
    assert data["total_s"] >= slow, name
    t_mb = data["micro_batch_s"]
    for row in data["rows"]:
        segs = sorted(row["segments"], key=lambda s: s[1])
        assert all(a[2] <= b[1] + 1e-12 for a, b in zip(segs, segs[1:], strict=False)), (
            f"{name}: overlap"
        )
        passes = sum(b - a for kind, a, b, mb in segs if mb >= 0)
        assert passes == pytest.approx(layout.grad_accum * t_mb, rel=1e-6), f"{name}: busy"
        mbs = {mb for kind, a, b, mb in segs if kind == "forward"}
        assert mbs == set(range(layout.grad_accum)), f"{name}: micro-batches"


def test_cli_writes_pngs(tmp_path, capsys):
    plot, step = tmp_path / "top.png", tmp_path / "step.png"
    flags = ["--arch", "gpt", "--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "64"]
    flags += ["--seq", "32", "--global-batch", "8", "--procs-per-node", "2", "--pp", "2"]
    assert main(["plan", *flags, "--plot", str(plot), "--timeline", str(step)]) == 0
    for path in (plot, step):
        assert path.read_bytes()[:8] == PNG, path


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_shared_core_timeline_is_the_run_the_step_time_charges(schedule):
    """4 ranks on 2 cores: the timeline is contention.py's run; the stage that ends last
    ends at the record's step_time_s, and each stage draws every micro-batch's forward."""
    shared = Cluster("m", procs_per_node=4, cores=2, latency_us=0.0, tp_call_us={"2": 500.0})
    planner = Planner(read_model(build(GPT)), shared, 8, GPT.seq, "fp32")
    lay = Layout(2, 1, 2, 0, 1, 4, schedule=schedule)
    rec, data = planner.evaluate(lay), timeline_data(planner, lay)
    last = max(s[2] for s in data["rows"][data["slow"]]["segments"])
    assert last == pytest.approx(rec["step_time_s"], rel=1e-9), schedule
    for row in data["rows"]:
        mbs = {mb for kind, a, b, mb in row["segments"] if kind == "forward"}
        assert mbs == set(range(4)), f"{schedule} stage {row['stage']}: micro-batches"
