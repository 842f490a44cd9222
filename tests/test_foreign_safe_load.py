"""Foreign checkpoints are read without running anything they carry, and DeepSpeed's flat ZeRO
partitions are cut where DeepSpeed cuts them (no processes: the arithmetic and the refusals;
test_deepspeed_import.py loads real DeepSpeed checkpoints)."""

import math
import os

import pytest
import torch
from planted import Planted

from shardwise.checkpoint.foreign import deepspeed_flat as flat
from shardwise.checkpoint.foreign.detect import DEEPSPEED, detect, open_checkpoint
from shardwise.checkpoint.foreign.safe_load import FragmentAddress, load_pt
from shardwise.checkpoint.manifest import CheckpointError


def _plant(tmp_path, file: str) -> tuple[str, str]:
    """A DeepSpeed-looking tag directory whose ``file`` carries a Planted object."""
    tag = tmp_path / "global_step3"
    tag.mkdir()
    marker = str(tmp_path / "written-by-the-pickle")
    (tmp_path / "latest").write_text("global_step3")
    model = {"module": {"w": torch.ones(2)}, "global_steps": 3, "payload": None}
    torch.save(model, tag / "mp_rank_00_model_states.pt")
    evil = Planted.__new__(Planted)
    evil.path = marker
    if file == "mp_rank_00_model_states.pt":
        model["payload"] = evil
        torch.save(model, tag / file)
    else:
        torch.save({"optimizer_state_dict": {"loss_scaler": evil}}, tag / file)
    return str(tag), marker


@pytest.mark.parametrize(
    "file", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
)
def test_a_planted_pickle_is_refused_naming_its_class_and_never_runs(tmp_path, file):
    tag, marker = _plant(tmp_path, file)
    assert detect(tag) == DEEPSPEED
    with pytest.raises(CheckpointError, match=r"refused.*'planted\.Planted'.*nothing of the file"):
        open_checkpoint(tag)
    assert not os.path.exists(marker), "the planted constructor ran"
    # The plant is live: an unrestricted load (DeepSpeed's own, weights_only=False) runs it.
    torch.load(os.path.join(tag, file), weights_only=False)
    assert os.path.exists(marker)


def test_the_engine_refuses_it_and_stays_as_it_was(tmp_path):
    import shardwise

    tag, marker = _plant(tmp_path, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    model = torch.nn.Linear(2, 1)
    engine, *_ = shardwise.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="planted.Planted"):
        engine.load_checkpoint(str(tmp_path))  # through "latest", as any load
    assert not os.path.exists(marker)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert engine.global_steps == 0


def test_a_legacy_non_zip_file_is_read_the_same_way(tmp_path):
    path = str(tmp_path / "old.pt")
    torch.save({"w": torch.arange(3.0)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load_pt(path)["w"], torch.arange(3.0))


SHAPES = {"a": (3, 5), "b": (7,), "c": (2, 2)}  # 15 + 7 + 4 = 26 elements


def _covered(frags_per_rank: list[list[flat.Fragment]]) -> dict[str, list[int]]:
    seen = {k: [0] * math.prod(s) for k, s in SHAPES.items()}
    for frags in frags_per_rank:
        for f in frags:
            for i in range(f.lo, f.hi):
                seen[f.name][i] += 1
    return seen


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("pads", [None, [1, 0, 0]])
def test_zero12_fragments_cover_every_element_once(world, pads):
    numel = flat.group_numel(SHAPES, pads)
    align = 2 * world  # DeepSpeed pads the group to a multiple of 2 x world
    part = -(-numel // align) * align // world
    frags = [flat.zero12_fragments(SHAPES, pads, part, r) for r in range(world)]
    assert all(n == [1] * len(n) for n in _covered(frags).values())
    for rank, fs in enumerate(frags):  # each fragment sits where the flat offsets say
        offsets = {"a": 0, "b": 15 + (pads or [0])[0], "c": 22 + (pads or [0])[0]}
        for f in fs:
            assert rank * part + f.at == offsets[f.name] + f.lo, (world, f)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero3_fragments_cover_every_element_once(world):
    frags = [flat.zero3_fragments(SHAPES, world, r) for r in range(world)]
    assert all(n == [1] * len(n) for n in _covered(frags).values())
    per_rank = flat.zero3_numel(SHAPES, world)
    assert all(f.at + f.hi - f.lo <= per_rank for fs in frags for f in fs)


def test_recorded_slices_that_disagree_are_refused():
    frags = flat.zero12_fragments(SHAPES, None, 14, 1)  # rank 1 of 2: elements 14..27
    good = {}
    for f in frags:
        good[f.name] = FragmentAddress.__new__(FragmentAddress)
        good[f.name].__dict__.update(numel=f.hi - f.lo, start=f.at)
    flat.check_mappings(frags, good, "rank 1")
    good["b"].__dict__["start"] += 1
    with pytest.raises(CheckpointError, match="cannot be mapped"):
        flat.check_mappings(frags, good, "rank 1")


def test_a_range_across_two_sub_groups_is_refused():
    assert flat.locate(5, 3, [4, 6], "x") == (1, 1)
    with pytest.raises(CheckpointError, match="not inside one"):
        flat.locate(3, 3, [4, 6], "x")


def test_inspect_names_shardwise_s_own_format(tmp_path, capsys):
    import shardwise
    from shardwise.launch.cli import main

    engine, *_ = shardwise.initialize(
        model=torch.nn.Linear(2, 1),
        config={"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0},
    )
    engine.save_checkpoint(str(tmp_path))
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("format: shardwise checkpoint (loads whole into any layout)"), out
    assert "model/weight" in out, out
