"""``shardwise plan``: the table, the JSON a tool can rely on, and a config that runs as is."""

from __future__ import annotations

import json

import pytest
import torch
from harness import run_distributed
from plan_runs import SMALL, pipeline

from shardwise.launch.cli import main
from shardwise.plan import Dims, Layout, plan

GPT_FLAGS = ["--arch", "gpt", "--layers", "4", "--hidden", "128", "--heads", "4"]
GPT_FLAGS += ["--vocab", "256", "--seq", "64", "--global-batch", "8"]
RECORD_KEYS = {
    "dp", "tp", "pp", "zero_stage", "micro_batch", "grad_accum", "activation_checkpointing",
    "offload", "feasible", "reason", "memory", "comm_bytes", "step_time_s", "ep", "cp",
    "cp_method",
}  # fmt: skip
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "buffers", "peak"}


def _json(capsys, *flags: str) -> list[dict]:
    assert main(["plan", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_records_have_the_documented_keys(capsys):
    recs = _json(capsys, *GPT_FLAGS, "--procs-per-node", "4")
    assert recs, "no layout at all"
    for r in recs:
        assert RECORD_KEYS <= r.keys(), sorted(RECORD_KEYS - r.keys())
        assert MEMORY_KEYS <= r["memory"].keys() and set(r["comm_bytes"]) == {
            "data",
            "tensor",
            "pipeline",
            "expert",
            "context",
        }
        assert (
            r["dp"] * r["tp"] * r["pp"] * r["cp"] == 4
            and r["dp"] * r["micro_batch"] * r["grad_accum"] == 8
        )
    times = [r["step_time_s"] for r in recs if r["feasible"]]
    assert times == sorted(times), "feasible layouts are ranked by predicted step time"
    kinds = {(r["tp"] > 1, r["pp"] > 1, r["zero_stage"]) for r in recs}
    assert {(False, False, 3), (True, False, 1), (False, True, 1), (True, True, 0)} <= kinds


def test_infeasible_layouts_say_why(capsys):
    recs = _json(capsys, *GPT_FLAGS, "--procs-per-node", "2", "--device-memory", "3MiB")
    bad = [r for r in recs if not r["feasible"]]
    good = [r for r in recs if r["feasible"]]
    assert bad and good, "3 MiB should fit some layouts of this 1M-parameter GPT, not all"
    for r in bad:
        assert r["reason"].startswith("needs ") and r["reason"].endswith("per rank, has 3.0 MiB")
        assert r["memory"]["peak"] > 3 << 20
    assert all(r["memory"]["peak"] <= 3 << 20 for r in good)
    assert main(["plan", *GPT_FLAGS, "--procs-per-node", "2", "--device-memory", "3MiB"]) == 0
    text = capsys.readouterr().out
    assert "feasible layouts of" in text and "infeasible, for example:" in text
    assert "per rank, has 3.0 MiB" in text


def test_python_api_returns_the_cli_records(capsys):
    recs = _json(capsys, *GPT_FLAGS, "--procs-per-node", "2", "--cluster", "h100-80g")
    d = Dims(layers=4, hidden=128, heads=4, vocab=256, seq=64)
    api = plan(dims=d, cluster="h100-80g", procs_per_node=2, global_batch=8)
    assert json.loads(json.dumps(api)) == recs


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--arch", "gpt", "--layers", "2", "--global-batch", "4"], "--hidden, --heads"),
        ([*GPT_FLAGS, "--cluster", "tpu-v9"], "no such preset"),
        ([*GPT_FLAGS, "--device-memory", "lots"], "--device-memory 'lots'"),
        (["--model", "plan_runs", "--seq", "16", "--global-batch", "4"], "pkg.module:build_fn"),
    ],
)
def test_bad_flags_name_the_flag(capsys, flags, message):
    assert main(["plan", *flags]) == 2
    assert message in capsys.readouterr().err


def _train_with(config_path: str, pp: int) -> float:
    from plan_runs import gpt, pipeline

    import shardwise

    cfg = json.loads(open(config_path).read())
    model = pipeline() if pp > 1 else gpt()
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(engine.dp_rank)
    x = torch.randint(
        0, SMALL["vocab_size"], (cfg["train_micro_batch_size_per_gpu"], 16), generator=g
    )
    data = iter([(x, torch.roll(x, -1, 1))] * cfg["gradient_accumulation_steps"])
    return float(engine.train_batch(data))


@pytest.mark.parametrize("fixed", [[], ["--pp", "2"], ["--tp", "2", "--zero-stage", "1"]])
def test_written_config_runs_as_is(tmp_path, capsys, fixed):
    """The best layout (or the best with some axes fixed) of the example GPT on 2 ranks,
    written by --write-config, trains a step without any edit."""
    path = tmp_path / "ds_config.json"
    flags = ["--model", "plan_runs:pipeline", "--seq", "16", "--global-batch", "8"]
    flags += ["--procs-per-node", "2", "--write-config", str(path), *fixed]
    assert main(["plan", *flags]) == 0, capsys.readouterr().err
    cfg = json.loads(path.read_text())
    pp = cfg.get("pipeline", {}).get("stages", 1)
    losses = run_distributed(_train_with, 2, str(path), pp)
    assert all(4.0 < loss < 4.3 for loss in losses), losses  # about ln(61) at the start
    if fixed:
        assert (pp, cfg.get("tensor_parallel", {}).get("size", 1)) == (
            (2, 1) if "--pp" in fixed else (1, 2)
        )


def test_model_flag_reads_a_build_function():
    """--model builds on the meta device: nothing is allocated, the shapes are the real ones."""
    with torch.device("meta"):
        pipe = pipeline()
    assert all(p.is_meta for p in pipe.parameters())


def test_quantized_flags_mark_the_stages_that_have_them_and_cut_data_bytes(capsys):
    """--zero-quantized-weights: stage 3 only; --zero-quantized-gradients: stages 2 and 3
    (docs/planner.md); their data bytes fall (the exact counts: test_plan_exact.py). Hidden
    512: matrices above the 100,000-element persistence threshold, so some are sharded."""
    flags = ["--arch", "gpt", "--layers", "2", "--hidden", "512", "--heads", "4", "--vocab"]
    flags += ["256", "--seq", "64", "--global-batch", "8", "--procs-per-node", "2", "--tp", "1"]
    flags += ["--pp", "1", "--cp", "1"]
    plain = {_layout_key(r): r for r in _json(capsys, *flags)}
    quant = _json(capsys, *flags, "--zero-quantized-weights", "--zero-quantized-gradients")
    assert {r["zero_stage"] for r in quant} == {0, 1, 2, 3}, "every stage planned"
    for r in quant:
        tag = str(_layout_key(r))
        assert (r["qw"], r["qg"]) == (r["zero_stage"] == 3, r["zero_stage"] >= 2), tag
        was = plain[_layout_key(r)]["comm_bytes"]["data"]
        if r["qg"] and r["dp"] * r["cp"] > 1:  # gradients at 1/8, weights at 1/4 or fp32
            assert r["comm_bytes"]["data"] < 0.7 * was, f"{tag}: {r['comm_bytes']} vs {was}"
        else:
            assert r["comm_bytes"]["data"] == was, tag


def _layout_key(r: dict) -> tuple:
    """The record's layout but for ZeRO++'s two flags."""
    return tuple(r[k] for k in Layout.__dataclass_fields__ if k not in ("qw", "qg"))
