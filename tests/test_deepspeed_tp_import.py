"""A DeepSpeed tensor-parallel checkpoint (a Megatron-style ``mpu``, model-parallel size 2)
resumes in shardwise at another layout, as DeepSpeed resumes it itself.

Real DeepSpeed 0.19 trains the Megatron-style model of deepspeed_tp_runs.py (column-parallel
then row-parallel Linear, a replicated LayerNorm and bias) 3 steps on 2 ranks (tp2, ZeRO-1) and
saves ``mp_rank_00/01_model_states.pt`` and ``zero_pp_rank_0_mp_rank_00/01_optim_states.pt``;
DeepSpeed resumes at that layout for 5 steps (the reference, its slices gathered whole). A
shardwise engine of the whole model loads the same tag into each target layout and trains the
same 5 steps.

Tolerance, fp32: every loss and every weight within 1e-6. Tensor parallelism and data
parallelism only reorder sums (a matmul's inner sum split in two partial sums then
all-reduced; a 4-row batch's gradient as 2 + 2 rows), ~1e-8 relative per step, and Adam
amplifies that little on this model in 5 steps (the same bound as test_deepspeed_import.py's
fp32 cells). A wrong split (a slice placed along the wrong dimension, a replicated copy taken
as a split) moves weights by about lr = 1e-2 per step.
"""

import re
import shutil

import pytest
import torch
from deepspeed_tp_runs import deepspeed_tp_save_and_resume, shardwise_resume
from harness import run_distributed

from shardwise.checkpoint.foreign.deepspeed import DeepSpeedReader
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.launch.cli import main

pytest.importorskip("deepspeed", reason="DeepSpeed 0.19 (pip install -e '.[bench]')")

WHOLE = {
    "norm.weight": (6,),
    "norm.bias": (6,),
    "fc1.weight": (8, 6),
    "fc1.bias": (8,),
    "fc2.weight": (3, 8),
    "fc2.bias": (3,),
}


@pytest.fixture(scope="module")
def tp2_zero1(tmp_path_factory) -> tuple[str, dict]:
    """DeepSpeed tp2 x ZeRO-1 on 2 ranks: (save directory, its own resume)."""
    path = str(tmp_path_factory.mktemp("ds-tp2-zero1"))
    return path, run_distributed(deepspeed_tp_save_and_resume, 2, 2, 1, path)[0]


TARGETS = [  # shardwise (ZeRO stage, ranks, tensor-parallel size)
    (0, 1, 1),
    (1, 2, 1),
    (1, 2, 2),
]


@pytest.mark.parametrize("target", TARGETS, ids=[f"sw-z{s}-{w}r-tp{t}" for s, w, t in TARGETS])
def test_a_tensor_parallel_deepspeed_tag_resumes_in_another_layout(tp2_zero1, target):
    path, ds = tp2_zero1
    stage, world, tp = target
    case = f"ds-tp2-z1-2r->sw-z{stage}-{world}r-tp{tp}"
    sw = run_distributed(shardwise_resume, world, stage, path, tp)
    for rank, got in enumerate(sw):
        where = f"{case} rank {rank}"
        assert got["counters"] == (3, 12), where
        assert got["client"] == {"note": "from deepspeed", "step": 3}, where
        assert got["losses"] == pytest.approx(ds["losses"], abs=1e-6), where
        assert got["params"].keys() == ds["params"].keys(), where
        for name, want in ds["params"].items():
            worst = (got["params"][name] - want).abs().max().item()
            assert worst <= 1e-6, f"{where}: {name} differs by {worst:.2e}"


def _tag(save_dir: str) -> str:
    return f"{save_dir}/global_step3"


def test_slices_are_placed_by_the_model_s_whole_shapes(tp2_zero1):
    """Column-parallel slices along dim 0, row-parallel along dim 1, replicated ones once."""
    with DeepSpeedReader(_tag(tp2_zero1[0]), shapes=WHOLE) as reader:
        boxes = {n: sorted(p.box for p in reader.pieces(n)) for n in reader.names()}
        assert boxes["model/fc1.weight"] == [((0, 4), (0, 6)), ((4, 8), (0, 6))]
        assert boxes["model/fc2.weight"] == [((0, 3), (0, 4)), ((0, 3), (4, 8))]
        assert boxes["model/fc2.bias"] == [((0, 3),)]
        assert boxes["optim/exp_avg/fc1.bias"] == [((0, 4),), ((4, 8),)]
        copies = [k for k in reader.dropped if k.startswith("tensor-parallel copies")]
        assert copies == [], reader.dropped  # the replicated copies are equal


@pytest.mark.parametrize(
    "shapes, refusal",
    [
        ({**WHOLE, "fc1.weight": (12, 6)}, "parameter 'fc1.weight'.* slice of shape \\(4, 6\\)"),
        ({**WHOLE, "fc2.weight": (6, 8)}, "parameter 'fc2.weight'.* this model's is \\(6, 8\\)"),
        ({**WHOLE, "fc1.bias": (8, 1)}, "parameter 'fc1.bias'"),
    ],
    ids=["3 parts, not 2", "two dimensions differ", "another rank"],
)
def test_a_slice_that_fits_no_split_is_refused_naming_the_parameter(tp2_zero1, shapes, refusal):
    with pytest.raises(CheckpointError, match=refusal):
        DeepSpeedReader(_tag(tp2_zero1[0]), shapes=shapes)


def test_replicated_copies_that_differ_load_rank_0_s_and_say_so(tp2_zero1, tmp_path):
    copy = tmp_path / "tag"
    shutil.copytree(_tag(tp2_zero1[0]), copy)
    state = torch.load(copy / "mp_rank_01_model_states.pt", weights_only=True)
    state["module"]["norm.weight"] = state["module"]["norm.weight"] + 0.25
    torch.save(state, copy / "mp_rank_01_model_states.pt")
    with DeepSpeedReader(str(copy), shapes=WHOLE) as reader:
        note = reader.dropped.get("tensor-parallel copies of model/norm.weight", "")
        assert re.search("differ by up to 0.25.*rank 0's loaded", note), reader.dropped
        rank0 = torch.load(copy / "mp_rank_00_model_states.pt", weights_only=True)
        (piece,) = reader.pieces("model/norm.weight")
        assert torch.equal(reader.read(piece), rank0["module"]["norm.weight"])


def test_inspect_names_the_tensor_parallel_degree(tp2_zero1, capsys):
    assert main(["checkpoint", "inspect", tp2_zero1[0]]) == 0
    out = capsys.readouterr().out
    assert "source layout: zero_stage 1, data_parallel 1, tensor_parallel 2" in out, out
    assert "tensor_parallel: 2 ranks' slices (mp_rank_00..01)" in out, out
