"""examples/gpt with --schedule: the zero-bubble schedules train the one-process model.

Same global batch (8 windows) as the one-process run, so the same seed trains the same model;
tolerance that of tests/test_example_gpt.py (losses and parameters within 1e-4 after six Adam
steps; a wrong micro-batch, scale or reduction is >= 1e-2 off)."""

import pytest
from test_example_gpt import _train, assert_trains_like


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt") / "one"
    _train(out, 1, ("--micro-batch", "4", "--grad-accum", "2"))
    return out


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_gpt_trains_like_one_process_under_a_zero_bubble_schedule(one_process, tmp_path, schedule):
    extra = ("--pp", "2", "--schedule", schedule, "--micro-batch", "2", "--grad-accum", "4")
    proc = _train(tmp_path / schedule, 2, extra)
    assert f"schedule {schedule}" in proc.stderr, proc.stderr
    if schedule == "zbv":  # 2 blocks + embeddings + head on 4 virtual stages, stage 0 both ends
        assert "stage 0 chunk 1" in proc.stderr, proc.stderr
    assert_trains_like(tmp_path / schedule, one_process, f"pp2 {schedule}")
