"""``shardwise verify``: layout names, refusals before anything starts, the batch split, the
tolerance rule, the report, and one run through the real launcher that exits 1 on a bug."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from waits import scaled

from shardwise.launch.cli import main
from shardwise.verify import cli as verify_cli
from shardwise.verify.compare import FP32, Verdict, compare
from shardwise.verify.layout_names import NO_CLIP_NORM, Layout, layout_config, parse_layouts
from shardwise.verify.report import render
from shardwise.verify.results import RunResult
from shardwise.verify.setup import micro_batches

REPO = Path(__file__).resolve().parents[1]
BUG_SCRIPT = REPO / "tests" / "scripts" / "verify_rms_norm.py"


@pytest.mark.parametrize(
    "text, want",
    [
        ("dp2", Layout("dp2", dp=2)),
        ("zero3x2", Layout("zero3x2", dp=2, zero=3)),
        ("dp2xtp2", Layout("dp2xtp2", dp=2, tp=2)),
        ("pp2xzero1x2", Layout("pp2xzero1x2", dp=2, pp=2, zero=1)),
        ("tp2xsp", Layout("tp2xsp", tp=2, sp=True)),
        ("dp2xcp2xulysses", Layout("dp2xcp2xulysses", dp=2, cp=2, ulysses=True)),
        ("dp4xzero3xmics2", Layout("dp4xzero3xmics2", dp=4, zero=3, mics=2)),
        ("dp4xzero3xhpz2", Layout("dp4xzero3xhpz2", dp=4, zero=3, hpz=2)),
        ("zero3x2xqwxqg", Layout("zero3x2xqwxqg", dp=2, zero=3, qw=True, qg=True)),
        ("zero2x2xqg", Layout("zero2x2xqg", dp=2, zero=2, qg=True)),
    ],
)
def test_layout_names(text, want):
    assert parse_layouts(text) == [want], text


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if the reference or any layout would start."""

    def started(*args, **kwargs):
        raise AssertionError("verify started a run before refusing the command")

    monkeypatch.setattr(verify_cli, "_reference", started)
    monkeypatch.setattr(verify_cli, "_launch", started)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--layouts", "dp2,tq2"], ["--layouts", "'tq2'", "dpN, tpN, ppN"]),
        (["--layouts", "zero3"], ["--layouts", "one data rank", "zero3x2"]),
        (["--layouts", "zero3x2xpp2"], ["--layouts", "ZeRO-3", "zero1"]),
        (["--layouts", "dp2,dp2"], ["--layouts", "twice"]),
        (["--layouts", "dp4xmics2"], ["--layouts", "mics2", "zero1"]),
        (["--layouts", "dp4xzero2xmics3"], ["--layouts", "multiple of 3"]),
        (["--layouts", "dp4xzero2xhpz2"], ["--layouts", "hpz2", "zero3"]),
        (["--layouts", "dp4xzero3xhpz3"], ["--layouts", "multiple of 3"]),
        (["--layouts", "dp2xulysses"], ["--layouts", "context-parallel", "cp2"]),
        (["--layouts", "zero2x2xqw"], ["--layouts", "qw quantizes the ZeRO-3", "add zero3"]),
        (["--layouts", "dp2xqg"], ["--layouts", "qg the gradient", "zero2 / zero3"]),
        (["--layouts", "dp2", "--steps", "0"], ["--steps 0", "at least 1"]),
        (["--layouts", "pp2"], ["--layouts pp2", "'pipeline' builder"]),
        (["--layouts", "dp3"], ["--layouts dp3", "8 rows", "multiple of 3"]),
        (["--layouts", "dp2", "--entry", "nope"], ["defines no nope()", "--entry"]),
    ],
)
def test_bad_commands_are_refused_before_anything_starts(nothing_starts, capsys, flags, says):
    code = main(["verify", str(BUG_SCRIPT), *flags])
    err = capsys.readouterr().err
    assert code == 2, f"{flags}: exit code {code}"
    for words in says:
        assert words in err, f"{flags}: the error does not say {words!r}:\n{err}"


def test_a_missing_script_is_refused(nothing_starts, capsys):
    assert main(["verify", "no/such.py", "--layouts", "dp2"]) == 2
    assert "'no/such.py' not found" in capsys.readouterr().err


def test_layout_config_sets_batches_and_parallel_blocks():
    base = {"gradient_accumulation_steps": 2, "train_batch_size": 99, "tensor_parallel": {"plan": {"a": "colwise"}}}  # fmt: skip
    cfg = layout_config(base, Layout("x", dp=2, tp=2, zero=3), global_batch=8)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"]) == (8, 2), cfg
    assert cfg["zero_optimization"] == {"stage": 3}, cfg
    assert cfg["tensor_parallel"] == {
        "plan": {"a": "colwise"},
        "size": 2,
        "sequence_parallel": False,
    }
    assert cfg["gradient_clipping"] == NO_CLIP_NORM, "the norm is measured only when clipping"
    assert base["train_batch_size"] == 99, "the script's config is left as it was"


def test_data_ranks_together_hold_each_micro_batch_of_one_process():
    x = torch.arange(12)
    one = list(micro_batches(x, gas=2, dp=1, dp_rank=0))
    ranks = [list(micro_batches(x, gas=2, dp=3, dp_rank=r)) for r in range(3)]
    for j in range(2):
        union = torch.cat([ranks[r][j] for r in range(3)])
        assert torch.equal(union, one[j]), f"micro-batch {j}: {union} vs {one[j]}"


@pytest.mark.parametrize("dp, gas", [(2, 1), (2, 2), (4, 2)])
def test_a_moe_reference_runs_each_ranks_rows_as_its_own_micro_batch(dp, gas):
    """MoE gates compute per rank: the reference for dpN runs dp x gas micro-batches, the
    (j dp + r)-th being rank r's j-th, so each gate sees the rows a rank's gate sees."""
    from shardwise.verify.layout_names import REFERENCE, layout_config, parse_layout, reference_for

    layout = parse_layout(f"dp{dp}")
    ref = reference_for(layout, per_rank=True)
    assert (ref.world, ref.split) == (1, dp), f"dp{dp}: {ref}"
    assert reference_for(layout, per_rank=False) is REFERENCE, "no MoE: the plain reference"
    assert reference_for(parse_layout("tp2"), per_rank=True) is REFERENCE, "one data rank"
    cfg = layout_config({"gradient_accumulation_steps": gas}, ref, 8 * dp * gas)
    assert (cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"]) == (
        gas * dp,
        8,
    ), f"dp{dp} gas{gas}: {cfg}"
    x = torch.arange(8 * dp * gas)
    one = list(micro_batches(x, gas * ref.split, 1, 0))
    ranks = [list(micro_batches(x, gas, dp, r)) for r in range(dp)]
    want = [ranks[r][j] for j in range(gas) for r in range(dp)]
    assert all(torch.equal(a, b) for a, b in zip(one, want, strict=True)), f"dp{dp} gas{gas}"


def _result(name: str, w: torch.Tensor, loss: float = 1.0, zero_grad=()) -> RunResult:
    return RunResult(name, [loss], [2.0], ["w"], [{"w": w}], zero_grad=list(zero_grad))


def test_a_few_noisy_elements_pass_and_a_moved_tensor_fails():
    want = _result("ref", torch.zeros(10_000))
    noisy = torch.zeros(10_000)
    noisy[:5] = 1e-3  # Adam's handful of elements (design notes): 0.05% of the tensor
    assert not compare(_result("ok", noisy), want, FP32, 2).diverged
    moved = torch.full((10_000,), 1e-4)  # every element by about lr: a wrong layout
    v = compare(_result("bad", moved), want, FP32, 2)
    assert v.diverged and (v.first_param, v.first_step) == ("w", 1), v.findings
    far = torch.zeros(10_000)
    far[0] = 1e-2  # one element beyond any rounding: a wrong layout too
    assert compare(_result("far", far), want, FP32, 2).diverged


@pytest.mark.parametrize(
    "n, beyond, diverged",
    [
        (1024, 2, False),  # RMSprop / Adagrad in a correct layout (verify --fuzz): 2 of 1024
        (1024, 3, False),  # the mean 1.02 plus two standard deviations
        (1024, 4, True),
        (100, 1, True),  # a small tensor: no element may move
        (3, 1, True),  # a 3-element bias with one wrong element is wrong
        (100_000, 120, False),
        (100_000, 130, True),
    ],
)
def test_the_elements_allowed_beyond_the_bound_are_a_poisson_mean_plus_two_sigma(
    n, beyond, diverged
):
    want = _result("ref", torch.zeros(n))
    got = torch.zeros(n)
    got[:beyond] = 1e-3  # beyond 1e-5, within 5e-3: amplified rounding noise, or a bug
    v = compare(_result("l", got), want, FP32, 2)
    assert v.diverged == diverged, f"{beyond} of {n} elements moved: {v.findings}"


def test_a_parameter_with_zero_gradient_is_not_judged():
    want = _result("ref", torch.zeros(4), zero_grad=["w"])
    v = compare(_result("l", torch.full((4,), 3e-3)), want, FP32, 2)
    assert not v.diverged and v.unjudged == ["w"], v.findings


def test_the_report_names_the_layout_parameter_and_step():
    ok = Verdict("dp2", 2, [0.0], [1e-7], 0.0)
    bad = Verdict("tp2", 2, [0.2], [0.5], 0.3, ["loss at step 1: 1.2 vs 1"], "fc1.weight", 1)
    text = render("s.py", 1, FP32, [ok, bad])
    rows = {line.split()[0]: line for line in text.splitlines() if line[:3] in ("dp2", "tp2")}
    assert rows["dp2"].endswith("ok") and " - " in rows["dp2"], text
    assert "fc1.weight (step 1)" in rows["tp2"] and rows["tp2"].endswith("DIVERGED"), text
    assert text.endswith("verify: 1 of 2 layouts diverged from one process"), text


def test_the_command_runs_a_layout_through_the_launcher_and_exits_1_on_a_bug(tmp_path):
    """tp2 splits fc1, whose output the RMS norm needs whole (one layout: a launch costs
    seconds; the passing runs are in test_verify_examples.py)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "shardwise", "verify", str(BUG_SCRIPT), "--layouts", "tp2"]
    cmd += ["--steps", "2", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=scaled(600))
    out = done.stdout
    assert done.returncode == 1, f"exit code {done.returncode}\n{out}\n{done.stderr}"
    row = next(line for line in out.splitlines() if line.startswith("tp2 "))
    assert row.split()[1] == "2", f"tp2 runs 2 processes: {row}"
    assert "fc1.weight (step 1)" in row and row.endswith("DIVERGED"), out
    assert "loss at step 1" in out, out
    assert (tmp_path / "tp2" / "params.safetensors").is_file(), "--out keeps each run's files"


def test_the_entry_point_in_the_docs_loads_and_trains(tmp_path):
    """docs/verify.md's example, as a script: loaded as verify loads it, trained in one process."""
    from shardwise.verify.setup import load_setup
    from shardwise.verify.worker import run_reference, write_initial_weights

    page = (REPO / "docs" / "verify.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "train.py"
    script.write_text(code + '\nif __name__ == "__main__":\n    raise SystemExit("ran as main")\n')
    setup = load_setup(script)
    write_initial_weights(setup, tmp_path / "init.safetensors")
    run = run_reference(setup, 2, tmp_path / "init.safetensors")
    assert len(run.losses) == 2 and run.norms[0] > 0, run
    assert run.names == ["0.weight", "0.bias", "2.weight", "2.bias"], run.names


def test_the_layout_name_decides_sizes_the_script_config_already_sets():
    base = {"zero_optimization": {"stage": 2}, "tensor_parallel": {"size": 2}}
    cfg = layout_config(base, Layout("dp2", dp=2), global_batch=8)
    assert cfg["zero_optimization"]["stage"] == 0, f"dp2 runs without ZeRO: {cfg}"
    assert cfg["tensor_parallel"]["size"] == 1, f"dp2 runs without TP: {cfg}"
    mics = layout_config(
        {"zero_optimization": {"mics_shard_size": 2}}, Layout("x", dp=2, zero=1), 8
    )
    assert mics["zero_optimization"]["mics_shard_size"] == -1, f"no mics part: flat ZeRO {mics}"
    hpz = layout_config({"zero_optimization": {"zero_hpz_partition_size": 2}}, Layout("x", dp=2), 8)
    assert hpz["zero_optimization"]["zero_hpz_partition_size"] == 1, f"no hpz part: off {hpz}"
    hpz = layout_config({}, Layout("x", dp=4, zero=3, hpz=2), 8)
    assert hpz["zero_optimization"]["zero_hpz_partition_size"] == 2, f"hpz2 part: on {hpz}"
    quantized = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    ref = layout_config({"zero_optimization": quantized}, Layout("x"), 8)["zero_optimization"]
    assert not any(ref[k] for k in quantized), f"no qw / qg part: exact communication {ref}"
    qw = layout_config({}, Layout("x", dp=2, zero=3, qw=True), 8)["zero_optimization"]
    assert qw == {"stage": 3, "zero_quantized_weights": True}, f"qw sets its key: {qw}"


def test_a_layout_that_did_not_run_counts_as_diverged():
    from shardwise.verify.compare import failed

    v = failed("pp2", 2, "exit code 1\n      ValueError: boom")
    text = render("s.py", 2, FP32, [v])
    row = next(line for line in text.splitlines() if line.startswith("pp2 "))
    assert v.diverged and row.endswith("DIVERGED"), text
    assert "pp2: did not run: exit code 1" in text and "ValueError: boom" in text, text
