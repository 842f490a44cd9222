"""``wall_clock_breakdown`` and ``memory_breakdown``: DeepSpeed's timer line and a memory line,
logged by rank 0 every ``steps_per_print`` steps.

The timers are checked against work of known length: a forward that sleeps 15 ms and a
backward that sleeps 10 ms, two micro-batches per step. DeepSpeed's global timers sum a
step's micro-batches, so the line must show fwd >= 30 ms and bwd_inner >= 20 ms per step
(lower bounds: sleeping may last longer, never shorter), bwd >= bwd_inner + bwd_allreduce
(they nest). The memory line must carry ``engine.memory_breakdown()``'s own figures.
"""

import re
import time

import torch
import torch.nn.functional as F
from harness import capture_logs, run_distributed
from models import TinyMLP, make_data
from pipe_models import micro_batches, pipeline_module

import shardwise
from shardwise.monitor import memory_line

FWD_SLEEP, BWD_SLEEP, GAS = 0.015, 0.010, 2
TIMER = re.compile(r"^time \(ms\)((?: \| \w+: [\d.]+)+)$")


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(BWD_SLEEP)
        return g


class SlowMLP(TinyMLP):
    def forward(self, x):
        time.sleep(FWD_SLEEP)
        return _SleepBackward.apply(super().forward(x))


def timer_lines(lines: list[str]) -> list[dict[str, float]]:
    out = []
    for line in lines:
        m = TIMER.match(line)
        if m:
            pairs = [p.split(": ") for p in m.group(1).split(" | ")[1:]]
            out.append({k: float(v) for k, v in pairs})
    return out


def _train(extra: dict) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        **extra,
    }
    torch.manual_seed(0)
    engine, *_ = shardwise.initialize(model=SlowMLP(), config=config)
    x, y = make_data(64)

    def steps():
        for i in range(4 * GAS):
            loss = F.mse_loss(engine(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4])
            engine.backward(loss)
            engine.step()
        return engine.memory_breakdown()

    memory, lines = capture_logs(steps)
    return {"memory": memory, "lines": lines}


def test_the_timer_line_shows_deepspeeds_timers_summed_over_micro_batches():
    got = run_distributed(_train, 2, {"wall_clock_breakdown": True})
    rows = timer_lines(got[0]["lines"])
    assert len(rows) == 2, f"one line every steps_per_print=2 of 4 steps: {got[0]['lines']}"
    for row in rows:
        assert list(row) == ["fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"], row
        assert row["fwd"] >= 1000 * GAS * FWD_SLEEP, f"fwd sums {GAS} micro-batches: {row}"
        assert row["bwd_inner"] >= 1000 * GAS * BWD_SLEEP, row
        assert row["bwd"] >= row["bwd_inner"] + row["bwd_allreduce"] - 0.02, row
        assert row["step"] > 0, row
    assert not timer_lines(got[1]["lines"]), "rank 0 alone reports"


def test_with_steps_per_print_null_the_timer_line_comes_every_step():
    # DeepSpeed logs its timers every step whatever steps_per_print says; null is its default.
    got = run_distributed(_train, 2, {"wall_clock_breakdown": True, "steps_per_print": None})
    rows = timer_lines(got[0]["lines"])
    assert len(rows) == 4, f"one line per step of 4: {got[0]['lines']}"
    assert not [x for x in got[0]["lines"] if x.startswith("step=")], "no step line when null"


def test_memory_breakdown_logs_the_engines_own_figures():
    got = run_distributed(_train, 2, {"memory_breakdown": True})[0]
    want = memory_line(got["memory"])
    assert got["lines"].count(want) == 2, f"{want!r} not twice in {got['lines']}"
    assert not timer_lines(got["lines"]), "no timer line without wall_clock_breakdown"


def test_nothing_is_timed_when_both_are_off():
    got = run_distributed(_train, 2, {})[0]
    assert not [x for x in got["lines"] if x.startswith(("time (ms)", "memory |"))], got["lines"]


def _train_pipeline() -> list[str]:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "wall_clock_breakdown": True,
    }
    engine, *_ = shardwise.initialize(model=pipeline_module("mlp", 2), config=config)
    batches = micro_batches("mlp", engine, 4, 2, 2)
    return capture_logs(lambda: [engine.train_batch(batches) for _ in range(2)])[1]


def test_a_pipeline_times_its_schedule_under_deepspeeds_names():
    lines = run_distributed(_train_pipeline, 2)
    rows = timer_lines(lines[0])  # rank 0 runs stage 0 and reports
    assert len(rows) == 2, lines[0]
    want = {"fwd", "bwd", "step", "batch_input", "pipe_send_output", "pipe_recv_grad"}
    assert want <= set(rows[0]), f"stage 0 phases: {rows[0]}"
    assert not timer_lines(lines[1]), "stage 1 (rank 1) does not report"


def test_the_timers_reach_the_monitors_as_deepspeeds_events(tmp_path):
    csv = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}}
    run_distributed(_train, 2, {"wall_clock_breakdown": True, **csv})
    names = sorted(p.name for p in (tmp_path / "j").iterdir())
    for event in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        assert f"Train_Samples_elapsed_time_ms_{event}.csv" in names, names
