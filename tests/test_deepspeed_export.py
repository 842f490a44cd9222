"""shardwise saves with ``format="deepspeed"``; DeepSpeed 0.19 resumes it as its own.

Each cell (ZeRO stage x dtype, 2 ranks): shardwise trains the tiny model 3 steps and saves in
DeepSpeed's format; real DeepSpeed at the same layout loads the files with its own
``load_checkpoint`` and trains 3 more steps; shardwise's own continuation (the saving engine
going on) is the reference (deepspeed_export_runs.py). Compared:

    the load: the fp32 masters and Adam moments DeepSpeed holds after its load (its
          safe_get_full_* accessors) equal bit for bit what shardwise held at the save;
    fp32: every loss and weight within 1e-6. Both sides run torch's AdamW on the same fp32
          masters and gradients; the gradients are averaged over the same 2 ranks (a sum of
          two values is exact in either order), so only the order of the per-rank backward's
          sums could differ (measured: equal to the bit or 1e-8);
    bf16: the first resumed loss within 1e-6 (the same bf16 weights compute the same forward),
          the later ones within 2e-3 relative and every weight within two bf16 ulps: DeepSpeed
          and shardwise round the bf16 gradients of another reduction order differently
          (the bound of test_deepspeed_import.py).

Counters, learning rate and client state arrive too. Two more cells: two parameter groups
(weights, biases) under ZeRO-1 bf16, and under ZeRO-3 fp32 with a ``sub_group_size`` that cuts
the groups into several flat sub-groups; a frozen bias (ZeRO-2/3) and a shared weight (ZeRO-1
fp32, ZeRO-3 bf16). Then format="deepspeed-universal" on 2 ranks, which DeepSpeed loads on 1
rank with load_universal. The files hold no class of shardwise's:
they load with torch's weights-only unpickler (and shardwise's own allow-list).
"""

import pytest
import torch
from deepspeed_export_runs import export_and_resume, universal_resume, universal_save
from harness import run_distributed

import shardwise
from shardwise.checkpoint.foreign.detect import open_checkpoint
from shardwise.launch.cli import main

pytest.importorskip("deepspeed", reason="DeepSpeed 0.19 (pip install -e '.[bench]')")

CELLS = [(stage, dtype, "") for dtype in ("fp32", "bf16") for stage in (0, 1, 2, 3)]
CELLS += [(1, "bf16", "groups"), (3, "fp32", "groups")]  # 2 parameter groups; ZeRO-3 sub-groups
# A frozen bias (ZeRO-2/3 save it apart: frozen_param_shapes, frozen_param_fragments) and a
# weight shared by two layers (shared_params; one parameter, two state-dict names)
CELLS += [(2, "fp32", "frozen"), (3, "fp32", "frozen"), (1, "fp32", "tied"), (3, "bf16", "tied")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("ds-export"))
    return root, run_distributed(export_and_resume, 2, CELLS, root)[0]


def _within_bf16_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int = 2) -> torch.Tensor:
    return (got - want).abs() <= ulps * 2.0**-7 * want.abs() + 1e-6


def _id(cell: tuple) -> str:
    return "sw-z{}-{}{}-2r->ds".format(*cell[:2], f"-{cell[2]}" if cell[2] else "")


@pytest.mark.parametrize("cell", CELLS, ids=[_id(c) for c in CELLS])
def test_deepspeed_resumes_a_shardwise_save_as_shardwise_goes_on(runs, cell):
    stage, dtype, variant = cell
    tag = f"shardwise z{stage} {dtype} {variant or '1 group'} 2 ranks -> DeepSpeed"
    found = runs[1][cell]
    _compare(found["shardwise"], found["deepspeed"], cell, tag)


def _compare(sw: dict, ds: dict, cell: tuple, tag: str) -> None:
    """DeepSpeed's load and continuation ``ds`` against shardwise's save and own ``sw``."""
    _, dtype, variant = cell
    assert ds["load_path"] is not None, f"{tag}: DeepSpeed found nothing to load"
    assert ds["loaded"].keys() == sw["held"].keys(), tag
    for name, want in sw["held"].items():
        assert torch.equal(ds["loaded"][name].float(), want), f"{tag}: {name} loaded differently"
    steps, samples, lr = ds["counters"]
    assert (steps, samples) == (3, 12), tag
    groups = 2 if variant == "groups" else 1  # WarmupLR after 3 steps, every group
    assert lr == pytest.approx([0.01 * 0.79248125] * groups, rel=1e-6), tag
    assert ds["client"]["note"] == "from shardwise", tag  # DeepSpeed's client state: every
    # key of the model file it does not restore itself (buffer_names, ds_config, ...) too
    assert ds["losses"][0] == pytest.approx(sw["losses"][0], abs=1e-6), tag
    if dtype == "fp32":
        assert ds["losses"] == pytest.approx(sw["losses"], abs=1e-6), tag
    else:
        assert ds["losses"] == pytest.approx(sw["losses"], rel=2e-3), tag
    assert ds["params"].keys() == sw["params"].keys(), tag
    for name, want in sw["params"].items():
        have = ds["params"][name]
        worst = (have - want).abs().max().item()
        if dtype == "fp32":
            assert worst <= 1e-6, f"{tag}: {name} differs by {worst:.2e}"
        else:
            assert _within_bf16_ulps(have, want).all(), f"{tag}: {name} by {worst:.2e}"


UNIVERSAL_CELLS = [(1, "fp32", ""), (3, "fp32", ""), (2, "bf16", "groups")]


@pytest.fixture(scope="module")
def universal(tmp_path_factory) -> tuple[str, dict, dict]:
    root = str(tmp_path_factory.mktemp("ds-universal"))
    sw = run_distributed(universal_save, 2, UNIVERSAL_CELLS, root)[0]
    return root, sw, run_distributed(universal_resume, 1, UNIVERSAL_CELLS, root)[0]


@pytest.mark.parametrize(
    "cell", UNIVERSAL_CELLS, ids=[_id(c) + "-universal-1r" for c in UNIVERSAL_CELLS]
)
def test_deepspeed_loads_a_shardwise_universal_folder_at_another_world_size(universal, cell):
    """shardwise on 2 ranks saves format="deepspeed-universal"; DeepSpeed on 1 rank loads it
    with ``"checkpoint": {"load_universal": true}`` (no ``ds_to_universal`` step) and goes on
    as shardwise went on (the bounds of the module docstring: the same global batch of 4 rows,
    whose gradient summed as 2 x 2 rows or as 4 differs by fp32 rounding only)."""
    root, sw, ds = universal
    stage, dtype, variant = cell
    tag = f"shardwise z{stage} {dtype} {variant or '1 group'} 2 ranks -> universal -> DeepSpeed 1 rank"
    path = f"{root}/universal-z{stage}-{dtype}-{variant}"
    with open(f"{path}/latest_universal") as f:
        assert f.read() == "global_step3", tag
    _compare(sw[cell], ds[cell], cell, tag)
    with open_checkpoint(f"{path}/global_step3") as reader:  # and shardwise reads it back
        assert reader.describe()["format"].endswith("universal checkpoint"), tag


def test_the_files_hold_plain_values_and_shardwise_reads_them_back(runs):
    """torch's weights-only unpickler opens the model files (no class at all) and shardwise's
    reader the whole tag (ZeRO-3's loss scaler by DeepSpeed's name, on its allow-list)."""
    root = runs[0]
    for stage, dtype, variant in CELLS:
        tag = f"{root}/z{stage}-{dtype}-{variant}/global_step3"
        name = "zero_pp_rank_0_mp_rank_00" if stage == 3 else "mp_rank_00"
        state = torch.load(f"{tag}/{name}_model_states.pt", weights_only=True)
        assert state["global_steps"] == 3 and state["note"] == "from shardwise", tag
        with open_checkpoint(tag) as reader:
            assert reader.meta["counters"]["global_steps"] == 3, tag


@pytest.mark.parametrize("stage", [1, 3])
def test_inspect_reads_a_shardwise_save_for_deepspeed(runs, stage, capsys):
    assert main(["checkpoint", "inspect", f"{runs[0]}/z{stage}-fp32-"]) == 0
    out = capsys.readouterr().out
    assert f"source layout: zero_stage {stage}, data_parallel 2, tensor_parallel 1" in out, out
    assert "client state: keys ['note']" in out, out


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"format": "torch"}, "format='torch'.*one of shardwise, deepspeed"),
        ({"format": "deepspeed", "async_save": True}, "async_save=True with format='deepspeed'"),
        ({"format": "deepspeed", "client_state": {"module": 1}}, "client_state key 'module'"),
        (
            {"format": "deepspeed", "zero": {"stage": 2, "round_robin_gradients": True}},
            "zero_optimization.round_robin_gradients",
        ),  # fmt: skip
        ({"format": "deepspeed", "fp16": True}, "fp16 is refused.*GPUs only"),
        ({"format": "deepspeed-universal", "fp16": True}, "'deepspeed-universal'.*fp16 is refused"),
        ({"format": "deepspeed-universal"}, "needs ZeRO stage 1-3"),
    ],
)
def test_a_format_it_cannot_write_is_refused_naming_the_argument(tmp_path, kwargs, message):
    m = torch.nn.Linear(2, 2)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {}}}
    if "zero" in kwargs:
        cfg["zero_optimization"] = kwargs.pop("zero")
    if kwargs.pop("fp16", False):
        cfg |= {"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    engine, *_ = shardwise.initialize(model=m, config=cfg)
    with pytest.raises(ValueError, match=message):
        engine.save_checkpoint(str(tmp_path), **kwargs)
