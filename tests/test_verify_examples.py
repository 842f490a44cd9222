"""The examples are verifiable: their ``shardwise_verify()`` entry points train like one
process in 2-process layouts (the GPT with AdamW: 2 steps keep Adam's noise far below the
bounds; the digits CNN with SyncBatchNorm over the data ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import run_distributed
from verify_cases import run_script

from shardwise.verify.compare import FP32, compare, still
from shardwise.verify.results import load_result, load_weights
from shardwise.verify.setup import load_setup
from shardwise.verify.worker import run_reference, write_initial_weights

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS = 2


@pytest.mark.parametrize(
    "script, layouts",
    [
        ("gpt/train.py", ["tp2", "pp2", "zero3x2", "cp2", "cp2xulysses"]),
        ("classify/train.py", ["dp2"]),
    ],
)
def test_example_trains_like_one_process(tmp_path, script, layouts):
    path = str(EXAMPLES / script)
    setup = load_setup(path)
    init = tmp_path / "init.safetensors"
    write_initial_weights(setup, init)
    want = run_reference(setup, STEPS, init)
    assert want.losses[0] > 0 and want.norms[0], f"{script}: no loss or norm in the reference"
    for layout in layouts:
        out = tmp_path / layout
        run_distributed(run_script, 2, path, layout, STEPS, str(init), str(out))
        v = compare(load_result(out), want, FP32, 2)
        assert not v.diverged, f"{script} {layout}: {v.findings}"
    assert not still(want, load_weights(init)), f"{script}: the reference never moved; test void"
