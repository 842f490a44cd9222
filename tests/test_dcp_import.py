"""A torch.distributed.checkpoint directory (torchtitan's keys, written by torch's own
``dcp.save``) resumes in shardwise under ZeRO on 2 ranks as the saving torch run goes on.

The torch run trains the model of deepspeed_runs.py 3 steps in one process (AdamW, WarmupLR),
saves with ``dcp.save`` and trains 5 more (the reference, dcp_runs.py); shardwise loads the
directory under ZeRO-1/2/3 on 2 ranks and trains the same 5 steps. The load is checked exactly
(weights, Adam moments), then losses and weights within 1e-6 (fp32; the only difference is a
4-row gradient summed as 2 x 2 rows). Also: a ``.metadata`` carrying a pickled object outside
DCP's own classes is refused, and its code never runs.
"""

import os
import pickle

import pytest
import torch
from dcp_runs import shardwise_dcp_resume, torch_save_dcp_and_go_on
from harness import run_distributed
from planted import Planted
from torch.distributed.checkpoint.state_dict import get_state_dict

from shardwise.checkpoint.foreign.detect import DCP, detect, open_checkpoint
from shardwise.checkpoint.manifest import CheckpointError


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_dcp_checkpoint_resumes_under_zero(stage, tmp_path):
    want = torch_save_dcp_and_go_on(str(tmp_path / "step-3"))
    assert detect(str(tmp_path / "step-3")) == DCP
    scratch = str(tmp_path / "shardwise")
    got = run_distributed(shardwise_dcp_resume, 2, stage, str(tmp_path), "step-3", scratch)
    saved = open_checkpoint(str(tmp_path / "step-3"))
    for name, value in got[0]["loaded"].items():  # the load itself, exact
        kind = "model" if name.startswith("master/") else name.rpartition("/")[0]
        source = saved.pieces(f"{kind}/{name.rpartition('/')[2]}")[0]
        assert torch.equal(value, saved.read(source)), f"zero{stage}: {name}"
    for rank, r in enumerate(got):
        where = f"DCP -> zero{stage} x 2, rank {rank}"
        assert r["counters"] == (3, 12) and r["lr"] == pytest.approx([0.0079248125]), where
        assert r["losses"] == pytest.approx(want["losses"], abs=1e-6), where
        for name, w in want["params"].items():
            worst = (r["params"][name] - w).abs().max().item()
            assert worst <= 1e-6, f"{where}: {name} differs by {worst:.2e}"


def test_a_planted_pickle_in_dcp_metadata_is_refused(tmp_path):
    path = tmp_path / "step-1"
    torch_save_dcp_and_go_on(str(path), before=1, after=1)
    marker = tmp_path / "written-by-the-pickle"
    evil = Planted.__new__(Planted)
    evil.path = str(marker)
    with open(path / ".metadata", "wb") as f:  # DCP writes it with plain pickle: so does this
        pickle.dump(evil, f)
    with pytest.raises(
        CheckpointError, match=r"refused: .metadata holds a pickled 'planted.Planted'"
    ):
        open_checkpoint(str(path))
    assert not os.path.exists(marker)


def test_get_state_dict_is_what_the_reference_saves():
    """The keys the reader maps are get_state_dict's (a guard against a torch change)."""
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    assert set(msd) == {"weight", "bias"} and set(osd["state"]) == {"weight", "bias"}
