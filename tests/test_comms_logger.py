"""``comms_logger``: DeepSpeed's per-op communication summary from ``comm.log_summary()``.

ZeRO-2 on two ranks issues a reduce-scatter per bucket per micro-batch and an all-gather per
bucket per step; the logger must book exactly the calls ``comm.stats()`` counts, under the
same payload sizes, filtered by ``prof_ops`` (DeepSpeed's op names accepted), with a line per
call when ``verbose`` and the caller's name when ``debug``. Latencies are real times, so only
their consistency is checked (total = count x mean up to DeepSpeed's trimmed mean, > 0).
"""

import contextlib
import io

import pytest
import torch.nn.functional as F
from harness import capture_logs, run_distributed
from models import make_data, make_model

import shardwise
from shardwise import comm
from shardwise.monitor.comms import bandwidths, convert_size


def _train(logger_block: dict | None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2},
    }
    if logger_block is not None:
        config["comms_logger"] = logger_block
    engine, *_ = shardwise.initialize(model=make_model(), config=config)
    comm.reset_stats()  # count the training's collectives only
    x, y = make_data(32)

    def steps():
        for i in range(3):
            loss = F.mse_loss(engine(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4])
            engine.backward(loss)
            engine.step()

    _, lines = capture_logs(steps)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = comm.log_summary(return_dict=True)["summary"]
    comm.configure(enabled=False)  # the worker process serves later tests
    return {"summary": summary, "stats": comm.stats(), "lines": lines, "out": printed.getvalue()}


def test_every_collective_is_booked_with_its_payload():
    got = run_distributed(_train, 2, {"enabled": True})
    for rank, g in enumerate(got):
        assert set(g["summary"]) == {"reduce_scatter", "all_gather"}, (rank, g["summary"])
        for op, sizes in g["summary"].items():
            calls, payload = g["stats"][op]["calls"], g["stats"][op]["bytes"]
            assert sum(s["count"] for s in sizes.values()) == calls, (rank, op)
            assert sum(size * s["count"] for size, s in sizes.items()) == payload, (rank, op)
            for s in sizes.values():
                assert s["total_latency_ms"] > 0 and s["avg_latency_ms"] > 0, (op, s)
                assert s["msg_size_str"] == convert_size(s["msg_size_bytes"])
    out = got[0]["out"].splitlines()
    assert out[0].split() == [
        *("Comm.", "Op", "Message", "Size", "Count", "Total", "Latency(ms)", "Avg"),
        *("Latency(ms)", "tput_avg", "(Gbps)", "busbw_avg", "(Gbps)"),
    ], out[0]
    assert "reduce_scatter" in out and "all_gather" in out, out
    assert got[1]["out"] == "", "rank 0 alone prints the table"


def test_prof_ops_keeps_the_named_collectives_only():
    block = {"enabled": True, "prof_all": False, "prof_ops": ["all_gather_into_tensor"]}
    got = run_distributed(_train, 2, block)[0]
    assert set(got["summary"]) == {"all_gather"}, got["summary"]


def test_verbose_logs_every_call_and_debug_names_the_caller():
    got = run_distributed(_train, 2, {"enabled": True, "verbose": True, "debug": True})[0]
    calls = got["stats"]["reduce_scatter"]["calls"] + got["stats"]["all_gather"]["calls"]
    verbose = [x for x in got["lines"] if x.startswith("comm op: ")]
    assert len(verbose) == calls, verbose
    assert "| time (ms): " in verbose[0] and "| busbw (Gbps): " in verbose[0], verbose[0]
    names = set(got["summary"])
    assert "all_gather | [Caller Func: step]" in names, names  # ZeroStrategy.step gathers
    assert "reduce_scatter | [Caller Func: _launch]" in names, names


@pytest.mark.parametrize("block", [None, {"enabled": False}])
def test_off_books_nothing(block):
    got = run_distributed(_train, 2, block)[0]
    assert got["summary"] == {} and "not enabled" in got["out"], got


@pytest.mark.parametrize(
    "op, n, busbw",
    [("all_reduce", 4, 12.0), ("all_gather", 4, 6.0), ("reduce_scatter", 2, 4.0), ("send", 2, 8.0)],
)
def test_bandwidths_follow_nccl_tests(op, n, busbw):
    # 1e9 bytes in 1 s: algbw = 8 Gbps; busbw = algbw * 2(n-1)/n, (n-1)/n, or 1 (module doc)
    assert bandwidths(op, 10**9, 1000.0, n) == pytest.approx((8.0, busbw))
