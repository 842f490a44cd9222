"""shardwise saves with ``format="dcp"``: torch's own DCP reader loads it, and so does shardwise
at another layout.

shardwise trains the model of deepspeed_runs.py 3 steps under ZeRO-3 on 2 ranks, saves with
format="dcp" (torchtitan's keys, torch's ``dcp.save``; the tensors dealt out to the 2 ranks) and
trains 3 more: the reference (dcp_runs.py). Then:

    plain torch in one process loads the directory with ``dcp.load`` into
        ``get_state_dict(model, AdamW)`` (``set_state_dict``, the scheduler's
        ``load_state_dict``): weights and Adam moments equal bit for bit what shardwise held,
        the step and learning rate arrive, and 3 more steps give shardwise's losses within 1e-6
        (fp32; the same AdamW on the same weights, the batch's gradient summed over 4 rows in
        one process instead of 2 x 2 rows: rounding only);
    shardwise under ZeRO-1 on 2 ranks loads it back (another flat layout): the same, exactly
        for the load and within 1e-6 for the losses.
"""

import os

import pytest
import torch
from dcp_runs import shardwise_dcp_resume, shardwise_save_dcp_and_go_on, torch_load_dcp_and_go_on
from harness import run_distributed

from shardwise.checkpoint.foreign.detect import DCP, detect


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict]:
    root = tmp_path_factory.mktemp("dcp-export")
    got = run_distributed(
        shardwise_save_dcp_and_go_on, 2, 3, str(root / "step-3"), str(root / "own")
    )
    return str(root), got[0]


def test_torch_dcp_load_reads_a_shardwise_save(saved):
    root, sw = saved
    assert detect(f"{root}/step-3") == DCP
    files = sorted(f for f in os.listdir(f"{root}/step-3") if f.endswith(".distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"], f"each rank writes its share: {files}"
    got = torch_load_dcp_and_go_on(f"{root}/step-3")
    assert got["loaded"].keys() == sw["held"].keys()
    for name, want in sw["held"].items():
        assert torch.equal(got["loaded"][name], want), f"torch dcp.load: {name}"
    assert got["step"] == 3 and got["lr"] == pytest.approx([0.0079248125]), "torch dcp.load"
    assert got["losses"] == pytest.approx(sw["losses"], abs=1e-6), "torch dcp.load"


def test_shardwise_loads_its_dcp_save_at_another_layout(saved, tmp_path):
    root, sw = saved
    got = run_distributed(shardwise_dcp_resume, 2, 1, root, "step-3", str(tmp_path), after=3)
    for name, want in sw["held"].items():
        assert torch.equal(got[0]["loaded"][name], want), f"zero3 x2 -> dcp -> zero1 x2: {name}"
    for rank, r in enumerate(got):
        where = f"zero3 x2 -> dcp -> zero1 x2, rank {rank}"
        assert r["counters"] == (3, 12) and r["lr"] == pytest.approx([0.0079248125]), where
        assert r["losses"] == pytest.approx(sw["losses"], abs=1e-6), where


def test_inspect_reads_a_shardwise_save_as_dcp(saved, capsys):
    from shardwise.launch.cli import main

    root, _ = saved
    assert main(["checkpoint", "inspect", root]) == 0  # root/latest names step-3
    out = capsys.readouterr().out
    assert f"format: torch.distributed.checkpoint (DCP) at {root}/step-3" in out, out
    assert "optimizer states: exp_avg, exp_avg_sq, step (12 tensors)" in out, out
