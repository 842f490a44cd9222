"""DeepSpeed checkpoints resume in shardwise at another layout, as DeepSpeed resumes them itself.

Each cell: real DeepSpeed 0.19 trains the tiny model 3 steps under one layout (ZeRO stage x
dtype x ranks) and saves; DeepSpeed resumes that checkpoint at the same layout and trains 5
steps (the reference); a shardwise engine in another layout (another ZeRO stage and/or number of
ranks, the same global batch) loads the same files and trains the same 5 steps
(deepspeed_runs.py). Compared:

    the load: fp32 masters and Adam moments of every parameter equal bit for bit what DeepSpeed's
          own resume holds after its load_checkpoint (its safe_get_full_* accessors);

    fp32: every loss within 1e-6 and every weight within 1e-6. The gradients of a 4-row batch
          summed as 4 rows or as 2 x 2 differ by fp32 rounding only (~1e-8 relative here), and
          Adam amplifies that little on this model (measured: weights within 2e-8).
    bf16: the first resumed loss within 1e-6 (the same weights compute the same forward), the
          later ones within 2e-3 relative, every weight within two bf16 ulps of its value
          (2^-7 relative) or 4e-4, the larger: DeepSpeed and shardwise round the bf16 gradients
          of another reduction order differently, one ulp at a time (measured: 1 ulp, losses
          4e-4 relative; 1.6e-3 from DeepSpeed's ZeRO-3 on 4 ranks). The 4e-4 is for a weight
          near zero, whose ulp is tiny but which moves by whole Adam steps (up to lr = 0.01
          each): a gradient one bf16 ulp off (up to 2^-7) changes a step by about as much, so 5
          steps differ by up to 5 x 0.01 x 2^-7 = 3.9e-4 (measured: one element of 0.weight,
          at 0.003, 1.1e-4 = 4.4 of its ulps off, in 4-rank cells; no other beyond 1 ulp).

Counters, learning rate and client state are checked too. The same comparison for models with
a frozen bias and with a weight two layers share, and for the universal folders DeepSpeed's own
``ds_to_universal`` makes of a 2-rank ZeRO-1/2/3 tag. Then ``shardwise checkpoint
inspect`` on a real checkpoint, and damaged ones refused, by inspect and by a load that leaves
the engine as it was. fp16 is not in the matrix: DeepSpeed
0.19 refuses fp16 on the CPU accelerator, so no test here can write an fp16 checkpoint.
"""

import os
import re
import shutil
import sys

import pytest
import torch
from deepspeed_runs import (
    adamw,
    config,
    deepspeed_pipeline_save_and_resume,
    deepspeed_save,
    deepspeed_save_and_resume,
    in_turn,
    model,
    shardwise_pipeline_resume,
    shardwise_resume,
)
from harness import run_distributed
from planted import Planted

import shardwise
from shardwise.checkpoint.manifest import CheckpointError
from shardwise.launch.cli import main

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed 0.19 (pip install -e '.[bench]')")

CELLS = [  # (DeepSpeed stage, dtype, ranks) -> (shardwise ZeRO stage, ranks)
    ((0, "fp32", 1), (3, 2)),
    ((1, "fp32", 1), (2, 2)),
    ((2, "fp32", 1), (0, 2)),
    ((3, "fp32", 1), (1, 2)),
    ((0, "fp32", 2), (0, 1)),
    ((1, "fp32", 2), (3, 1)),
    ((2, "fp32", 2), (3, 2)),
    ((3, "fp32", 2), (2, 4)),
    ((0, "bf16", 1), (2, 2)),
    ((1, "bf16", 1), (3, 4)),
    ((2, "bf16", 1), (1, 2)),
    ((3, "bf16", 1), (0, 2)),
    ((0, "bf16", 2), (3, 1)),
    ((1, "bf16", 2), (0, 1)),
    ((2, "bf16", 2), (3, 2)),
    ((3, "bf16", 2), (1, 1)),
]


def _id(cell) -> str:
    (stage, dtype, world), (to_stage, to_world) = cell
    return f"ds-z{stage}-{dtype}-{world}r->sw-z{to_stage}-{to_world}r"


def _within_bf16_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int = 2) -> torch.Tensor:
    """Two bf16 ulps of the value, or 4e-4 near zero (module docstring)."""
    return (got - want).abs() <= torch.clamp(ulps * 2.0**-7 * want.abs(), min=4e-4)


@pytest.mark.parametrize("source, target", CELLS, ids=[_id(c) for c in CELLS])
def test_a_deepspeed_checkpoint_resumes_in_another_layout(source, target, tmp_path):
    stage, dtype, world = source
    ds = run_distributed(deepspeed_save_and_resume, world, stage, dtype, str(tmp_path))[0]
    _resume_and_compare(ds, dtype, target, tmp_path, _id((source, target)))


FOUR_RANK_CELLS = [  # (DeepSpeed stage, dtype, 4 ranks) -> (shardwise ZeRO stage, ranks)
    ((0, "fp32", 4), (2, 1)),
    ((1, "fp32", 4), (3, 2)),
    ((2, "fp32", 4), (1, 4)),
    ((3, "fp32", 4), (0, 2)),
    ((0, "bf16", 4), (3, 4)),
    ((1, "bf16", 4), (2, 1)),
    ((2, "bf16", 4), (0, 2)),
    ((3, "bf16", 4), (1, 1)),
]


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory) -> dict:
    """Every FOUR_RANK_CELLS cell, run in batches (a 4-rank world that imports DeepSpeed costs
    seconds; its 8 runs, under a second each): DeepSpeed saves and resumes each source in turn
    in one 4-rank task, then shardwise resumes every checkpoint of one target size in one task.
    Keyed by cell id: (DeepSpeed's per-rank results, shardwise's), each result a dict or the
    traceback that call raised (``in_turn``)."""
    root = tmp_path_factory.mktemp("ds-4r")
    path = {_id(c): str(root / _id(c)) for c in FOUR_RANK_CELLS}
    runs = {_id(c): ([], []) for c in FOUR_RANK_CELLS}  # id -> (DeepSpeed's, shardwise's)
    calls = [((c[0][0], c[0][1], path[_id(c)]), {}) for c in FOUR_RANK_CELLS]  # stage, dtype
    for rank_results in run_distributed(in_turn, 4, deepspeed_save_and_resume, calls, timeout=360):
        for cell, got in zip(FOUR_RANK_CELLS, rank_results, strict=True):
            runs[_id(cell)][0].append(got)
    for world in (1, 2, 4):  # the target sizes
        cells = [c for c in FOUR_RANK_CELLS if c[1][1] == world]
        calls = [((c[1][0], c[0][1], path[_id(c)], path[_id(c)] + "/sw"), {}) for c in cells]
        for rank_results in run_distributed(in_turn, world, shardwise_resume, calls):
            for cell, got in zip(cells, rank_results, strict=True):
                runs[_id(cell)][1].append(got)
    return runs


@pytest.mark.parametrize("source, target", FOUR_RANK_CELLS, ids=[_id(c) for c in FOUR_RANK_CELLS])
def test_a_four_rank_deepspeed_checkpoint_resumes_in_another_layout(source, target, four_rank_runs):
    """The cells above, for a DeepSpeed world of 4 ranks (batched: ``four_rank_runs``)."""
    tag = _id((source, target))
    ds, sw = four_rank_runs[tag]
    for side, results in (("DeepSpeed", ds), ("shardwise", sw)):
        for rank, got in enumerate(results):
            if isinstance(got, str):
                pytest.fail(f"{tag}: {side} raised on rank {rank}:\n{got}")
    _compare(ds[0], sw, source[1], tag)


PIPELINE_CELLS = [  # (DeepSpeed ZeRO stage, dtype) of 2 stages on 2 ranks -> shardwise
    ((1, "fp32"), (2, 2)),
    ((0, "fp32"), (0, 1)),
    # A bf16 pipeline steps DeepSpeed's BF16_Optimizer (bf16_zero files, no param_shapes);
    # DeepSpeed 0.19 cannot resume it itself (KeyError in BF16_Optimizer's load), so its
    # reference is the saving engine going on.
    ((0, "bf16"), (3, 2)),
]


@pytest.mark.parametrize(
    "source, target",
    PIPELINE_CELLS,
    ids=[f"ds-pp2-z{s}-{d}->sw-z{t}-{w}r" for (s, d), (t, w) in PIPELINE_CELLS],
)
def test_a_deepspeed_pipeline_checkpoint_resumes_without_a_pipeline(source, target, tmp_path):
    """The layer files of a 2-stage DeepSpeed pipeline load into the plain model (the same
    parameter names), its per-stage optimizer files merged."""
    stage, dtype = source
    tag = f"ds-pp2-z{stage}-{dtype}->sw-z{target[0]}-{target[1]}r"
    own = dtype == "fp32"
    ds = run_distributed(deepspeed_pipeline_save_and_resume, 2, stage, dtype, str(tmp_path), own)
    ds = ds[0]
    _resume_and_compare(ds, dtype, target, tmp_path, tag)


def test_a_deepspeed_checkpoint_resumes_in_a_shardwise_pipeline(tmp_path):
    """DeepSpeed ZeRO-1 on 2 ranks -> a 2-stage shardwise pipeline on 2 ranks."""
    ds = run_distributed(deepspeed_save_and_resume, 2, 1, "fp32", str(tmp_path))[0]
    tag = "ds-z1-fp32-2r->sw-pp2-z0-2r"
    _resume_and_compare(ds, "fp32", (0, 2), tmp_path, tag, shardwise_pipeline_resume)


VARIANT_CELLS = [  # (DeepSpeed ZeRO stage, ranks, model variant) in fp32 -> (shardwise stage, ranks)
    ((2, 2, "frozen"), (3, 1)),
    ((3, 2, "frozen"), (1, 2)),
    ((1, 1, "tied"), (3, 2)),
    ((3, 2, "tied"), (0, 1)),
]


@pytest.mark.parametrize(
    "source, target",
    VARIANT_CELLS,
    ids=[f"ds-z{s}-fp32-{w}r-{v}->sw-z{t}-{tw}r" for (s, w, v), (t, tw) in VARIANT_CELLS],
)
def test_frozen_and_tied_parameters_resume_in_another_layout(source, target, tmp_path):
    """A frozen bias (requires_grad False: in no optimizer group; ZeRO-2/3 save it apart, in
    frozen_param_shapes and per-rank frozen_param_fragments) and a weight two layers share
    (one parameter; DeepSpeed's shared_params names the alias)."""
    stage, world, variant = source
    ds = run_distributed(
        deepspeed_save_and_resume, world, stage, "fp32", str(tmp_path), 3, 5, variant
    )
    tag = f"ds-z{stage}-fp32-{world}r-{variant}->sw-z{target[0]}-{target[1]}r"
    _resume_and_compare(ds[0], "fp32", target, tmp_path, tag, variant=variant)


UNIVERSAL_CELLS = [  # (DeepSpeed ZeRO stage, dtype) on 2 ranks -> shardwise (ZeRO stage, ranks)
    ((1, "fp32"), (3, 1)),
    ((2, "fp32"), (0, 1)),
    ((3, "fp32"), (1, 2)),
    ((1, "bf16"), (2, 2)),
]


@pytest.mark.parametrize(
    "source, target",
    UNIVERSAL_CELLS,
    ids=[f"ds-z{s}-{d}-2r-universal->sw-z{t}-{w}r" for (s, d), (t, w) in UNIVERSAL_CELLS],
)
def test_a_universal_folder_of_ds_to_universal_resumes_in_another_layout(
    source, target, tmp_path, monkeypatch
):
    """DeepSpeed's own ``ds_to_universal`` (run here, in this process, as its command line
    does) turns the 2-rank tag into a universal folder (whole tensors under zero/); shardwise
    loads that folder and goes on as DeepSpeed's own resume of the original tag does."""
    from deepspeed.checkpoint import ds_to_universal

    stage, dtype = source
    ds = run_distributed(deepspeed_save_and_resume, 2, stage, dtype, str(tmp_path))[0]
    folder = str(tmp_path / "global_step3_universal")
    args = ["--input_folder", str(tmp_path / "global_step3"), "--output_folder", folder]
    args += ["--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    monkeypatch.setattr(sys, "argv", ["ds_to_universal.py", *args])
    ds_to_universal.main(ds_to_universal.parse_arguments())
    assert os.path.isfile(f"{folder}/zero/0.weight/exp_avg_sq.pt"), "no universal folder"
    tag = f"ds-z{stage}-{dtype}-2r-universal->sw-z{target[0]}-{target[1]}r"
    _resume_and_compare(ds, dtype, target, tmp_path, tag, load_tag="global_step3_universal")


def _resume_and_compare(
    ds: dict,
    dtype: str,
    target: tuple,
    tmp_path,
    tag: str,
    resume=shardwise_resume,
    load_tag: str | None = None,
    variant: str = "",
) -> None:
    """shardwise loads tmp_path's DeepSpeed checkpoint (the tag ``latest`` names, or
    ``load_tag``) into ``target`` and trains on: compared with DeepSpeed's own resume ``ds``
    (module docstring)."""
    to_stage, to_world = target
    scratch = str(tmp_path / "shardwise")
    kwargs = {} if load_tag is None else {"tag": load_tag}
    kwargs |= {"variant": variant} if variant else {}
    sw = run_distributed(resume, to_world, to_stage, dtype, str(tmp_path), scratch, **kwargs)
    _compare(ds, sw, dtype, tag)


def _compare(ds: dict, sw: list[dict], dtype: str, tag: str) -> None:
    """shardwise's resume ``sw`` (every rank's result) against DeepSpeed's own ``ds``."""
    loaded = sw[0]["loaded"]
    assert loaded.keys() == ds["loaded"].keys(), tag
    for name, want in ds["loaded"].items():  # the load itself: exact, whatever the layouts
        assert torch.equal(loaded[name], want.float()), f"{tag}: {name} loaded differently"
    for rank, got in enumerate(sw):
        where = f"{tag} rank {rank}"
        assert got["counters"] == (3, 3 * 4), where
        assert got["client"] == {"note": "from deepspeed", "step": 3}, where
        assert got["lr"] == pytest.approx([0.01 * 0.79248125], rel=1e-6), where  # WarmupLR, it 2
        assert got["losses"][0] == pytest.approx(ds["losses"][0], abs=1e-6), where
        if dtype == "fp32":
            assert got["losses"] == pytest.approx(ds["losses"], abs=1e-6), where
        else:
            assert got["losses"] == pytest.approx(ds["losses"], rel=2e-3), where
        assert got["params"].keys() == ds["params"].keys(), where
        for name, want in ds["params"].items():
            have = got["params"][name]
            worst = (have - want).abs().max().item()
            if dtype == "fp32":
                assert worst <= 1e-6, f"{where}: {name} differs by {worst:.2e}"
            else:
                assert _within_bf16_ulps(have, want).all(), f"{where}: {name} by {worst:.2e}"


@pytest.fixture(scope="module")
def zero2_two_ranks(tmp_path_factory) -> str:
    """A DeepSpeed ZeRO-2 fp32 checkpoint saved by 2 ranks (save directory, with 'latest')."""
    path = str(tmp_path_factory.mktemp("ds-zero2"))
    run_distributed(deepspeed_save, 2, 2, "fp32", path)
    return path


def test_inspect_names_the_format_the_layout_and_what_loads(zero2_two_ranks, capsys):
    assert main(["checkpoint", "inspect", zero2_two_ranks]) == 0
    out = capsys.readouterr().out
    assert f"format: DeepSpeed {deepspeed.__version__} checkpoint at " in out, out
    assert "source layout: zero_stage 2, data_parallel 2, tensor_parallel 1" in out, out
    assert "optimizer states: exp_avg, exp_avg_sq, step (12 tensors)" in out, out
    assert "counters: {'micro_steps': 3, 'global_steps': 3, 'global_samples': 12" in out, out
    assert "client state: keys ['note', 'step']" in out, out
    assert "clip_grad: gradient clipping comes from this run's config" in out, out
    assert "master/0.weight" in out and "optim/exp_avg/2.bias" in out, out


def _engine():
    m = model(seed=5)
    engine, *_ = shardwise.initialize(model=m, optimizer=adamw(m), config=config(1, "fp32", 1))
    return engine, {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize(
    "damage, refusal",
    [
        ("drop rank 1's optimizer file", "smaller than its parameters"),
        ("make it tensor-parallel", "tensor-parallel ranks 0 and 1 hold different tensors"),
        ("add a stray model file", "2 model-state files .* 1 pipeline stages"),
        ("drop rank 0's optimizer file", r"ranks \[1\]: some are missing"),
    ],
)
def test_a_checkpoint_that_cannot_be_mapped_fully_is_refused_before_anything_changes(
    zero2_two_ranks, tmp_path, capsys, damage, refusal
):
    copy = tmp_path / "ckpt"
    shutil.copytree(zero2_two_ranks, copy)
    tag = copy / (copy / "latest").read_text().strip()
    if damage.startswith("drop"):
        rank = damage.split()[2][0]  # "drop rank R's ..."
        (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").unlink()
    else:  # a second model-parallel rank's file (the model file holds plain types only)
        state = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
        if damage == "make it tensor-parallel":
            state["checkpoint_parallel_dimensions"]["tp_degree"] = 2
            torch.save(state, tag / "mp_rank_00_model_states.pt")
        torch.save(state, tag / "mp_rank_01_model_states.pt")
    assert main(["checkpoint", "inspect", str(copy)]) != 0
    assert re.search(f"format: deepspeed .* refused: .*{refusal}", capsys.readouterr().err)
    engine, before = _engine()
    with pytest.raises(CheckpointError, match=refusal):
        engine.load_checkpoint(str(copy))
    assert engine.global_steps == 0 and engine.get_lr() == [0.0]
    for name, value in engine.module.state_dict().items():
        assert torch.equal(value, before[name]), f"{damage}: {name} changed"


def test_a_trainer_checkpoint_folder_around_it_loads_and_its_pickles_stay_closed(
    zero2_two_ranks, tmp_path
):
    """The Hugging Face Trainer saves DeepSpeed's files into ``checkpoint-N/`` (``latest``,
    ``global_stepN/``) beside pickles of its own (training_args.bin, rng_state.pth): the
    folder loads like a DeepSpeed save directory, and those pickles are never opened (here
    one would write a file if it were). The layout is reproduced from a real DeepSpeed save;
    the Trainer itself is not run (it needs accelerate, not installed here)."""
    folder = tmp_path / "output" / "checkpoint-3"
    shutil.copytree(zero2_two_ranks, folder)
    (folder / "trainer_state.json").write_text('{"global_step": 3}')
    marker = tmp_path / "written-by-training-args"
    evil = Planted.__new__(Planted)
    evil.path = str(marker)
    torch.save(evil, folder / "training_args.bin")
    torch.save({"python": 1}, folder / "rng_state.pth")
    engine, before = _engine()
    path, client = engine.load_checkpoint(str(folder))
    assert path == str(folder / "global_step3") and client == {"note": "from deepspeed", "step": 3}
    assert engine.global_steps == 3 and not marker.exists()
    assert not all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())
