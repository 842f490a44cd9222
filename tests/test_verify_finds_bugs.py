"""``shardwise verify`` finds real mistakes and names them, and passes correct layouts.

Each case trains a small setup in one process (here) and in a 2-process layout (a harness
world running the verifier's own worker code), then compares them as the command does. SGD
with momentum, so the fp32 bounds apply to every element (compare.py); 3 steps. A mistake
shows at once: the wrong normalization changes the step-1 loss by ~1e-1, a parameter left out
of the optimizer never moves while the reference moves it by lr x grad ~1e-2, and a shared
dropout stream is a mask equal on both ranks (probability 2^-64 for independent draws).
"""

from __future__ import annotations

import pytest
from harness import run_distributed
from verify_cases import CASES, run_case

from shardwise.verify.compare import FP32, compare
from shardwise.verify.results import load_result
from shardwise.verify.worker import run_reference, write_initial_weights

STEPS = 3


def verify_case(tmp_path, case: str, layout: str, bug: str = ""):
    """The verdict of ``layout`` against one process for setup ``case`` (``.reference`` holds
    the one-process run)."""
    setup = CASES[case]()
    init = tmp_path / "init.safetensors"
    write_initial_weights(setup, init)
    want = run_reference(setup, STEPS, init)
    out = tmp_path / layout
    run_distributed(run_case, 2, case, layout, STEPS, str(init), str(out), bug)
    verdict = compare(load_result(out), want, FP32, 2)
    verdict.reference = want
    return verdict


def test_tp_plan_splitting_a_layer_whose_output_is_used_whole_is_found(tmp_path):
    v = verify_case(tmp_path, "rms_norm_over_split_output", "tp2")
    assert v.diverged, "tp2, RMS norm over fc1's split output: not found"
    assert v.first_param == "fc1.weight" and v.first_step == 1, f"tp2: named {v.findings}"
    assert v.findings[0].startswith("loss at step 1"), f"tp2: {v.findings}"


def test_the_same_plan_without_the_norm_passes(tmp_path):
    v = verify_case(tmp_path, "mlp", "tp2")
    assert not v.diverged, f"tp2, plain MLP: {v.findings}"
    assert max(v.loss_diffs) <= 1e-6, f"tp2, plain MLP: loss diffs {v.loss_diffs}"


def test_a_parameter_missing_from_the_zero3_optimizer_is_named(tmp_path):
    v = verify_case(tmp_path, "mlp", "zero3x2", bug="zero3_drops_first_master")
    assert v.diverged, "zero3x2 without fc1's master in the optimizer: not found"
    assert v.first_param == "fc1.weight" and v.first_step == 1, f"zero3x2: {v.findings}"
    # Step 1's loss comes before any update, so it differs from one process's by rounding
    # only: two half-batch means averaged against one mean of the whole batch, a few ulps of
    # the loss whatever matmul kernels the CPU picks (CI once saw 5.96e-08 = 2^-24 on a loss
    # near 1 where this machine gives 0.0). The bug shows from step 2 on, 1e-2 and more.
    step1 = v.reference.losses[0]
    assert FP32.close(step1 + v.loss_diffs[0], step1), f"zero3x2: step 1 loss: {v.loss_diffs}"
    assert not v.findings[0].startswith("loss at step 1"), f"zero3x2: {v.findings}"


def test_zero3_without_the_bug_passes(tmp_path):
    v = verify_case(tmp_path, "mlp", "zero3x2")
    assert not v.diverged, f"zero3x2: {v.findings}"


@pytest.mark.parametrize(
    "case, shared",
    [("dropout_shared_stream", True), ("dropout_split_streams", False)],
)
def test_a_dropout_stream_shared_across_tp_ranks_is_found(tmp_path, case, shared):
    v = verify_case(tmp_path, case, "tp2")
    stream = [f for f in v.findings if f.startswith("dropout")]
    if shared:
        assert v.diverged and stream, f"tp2 {case}: not found: {v.findings}"
        assert "'drop'" in stream[0] and "split_dropout" in stream[0], f"tp2 {case}: {stream}"
    else:
        assert not v.diverged, f"tp2 {case}: {v.findings}"
