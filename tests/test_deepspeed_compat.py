"""Every DeepSpeed name docs/deepspeed-compat.md lists as working resolves under shardwise, and a
DeepSpeed-style script using them trains, saves and resumes on two processes."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_distributed
from waits import scaled

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `(deepspeed(?:\.\w+)+)` \| (works|alias|refused) \|")


def listed() -> list[tuple[str, str]]:
    lines = (REPO / "docs" / "deepspeed-compat.md").read_text().splitlines()
    return [m.groups() for m in map(ROW.match, lines) if m]


def resolve(dotted: str) -> object:
    """``deepspeed.a.b.c`` as ``import shardwise as deepspeed`` sees it: attribute access from
    the package, then the deepest importable module (``from deepspeed.a.b import c``)."""
    parts = ["shardwise", *dotted.split(".")[1:]]
    obj: object = importlib.import_module("shardwise")
    for name in parts[1:]:
        obj = getattr(obj, name)
    return obj


def test_the_table_lists_the_names_scripts_reach_for():
    names = {n for n, _ in listed()}
    assert len(names) >= 30, "the compatibility table lost its rows"
    for must in (
        "deepspeed.accelerator.get_accelerator",
        "deepspeed.runtime.utils.set_random_seed",
    ):
        assert must in names, must


@pytest.mark.parametrize("name, status", listed())
def test_every_listed_name_resolves(name, status):
    if status == "refused":
        with pytest.raises(AttributeError):
            resolve(name)
        return
    assert resolve(name) is not None, name
    module, _, attr = name.rpartition(".")
    if module != "deepspeed":  # `from deepspeed.x import y` works too
        mod = importlib.import_module("shardwise." + module.split(".", 1)[1])
        assert getattr(mod, attr) is resolve(name), name


def test_cpu_accelerator_answers_as_deepspeeds():
    from shardwise.accelerator.devices import CpuAccelerator

    acc = CpuAccelerator()
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name()) == ("cpu",) * 3
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert acc.device_count() == 1 and acc.current_device() == 0
    assert 0 < acc.memory_allocated() <= acc.total_memory()


def test_a_deepspeed_style_script_using_the_deep_names_trains_and_resumes(tmp_path):
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", "2"]
    cmd += [str(REPO / "tests" / "scripts" / "ds_deep_names.py"), "--save_dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=scaled(240), env=env, cwd=REPO
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "resumed epoch=7 steps=4 device=cpu" in out.stdout, out.stdout[-2000:]
    for rank in (0, 1):  # deepspeed.comm: what each call answered on this rank
        assert (
            f"comm rank={rank} world=2 local_rank={rank} all_reduce=3.0 logged=[4] count=1 "
            f"meta={rank},2 mark_after_barrier=True"
        ) in out.stdout, f"rank {rank}: {out.stdout[-2000:]}"
    # see_memory_usage: DeepSpeed's report, printed once (rank 0)
    assert re.search(r"after training\nMA [\d.]+ GB Max_MA ", out.stdout), out.stdout
    assert out.stdout.count("after training") == 1, out.stdout[-2000:]
    logs = out.stdout + out.stderr  # log_dist: None nowhere, [1] on rank 1, [-1] everywhere
    got = sorted(set(re.findall(r"\[Rank (\d)\] log_dist to (\S+)", logs)))
    assert got == [("0", "[-1]"), ("1", "[-1]"), ("1", "[1]")], got


# --- deepspeed.utils.groups on two processes ---------------------------------------------------

GROUP_FUNCTIONS = [  # the functions returning a process group
    "_get_data_parallel_group", "get_data_parallel_group", "_get_sequence_data_parallel_group",
    "get_tensor_model_parallel_group", "get_model_parallel_group",
]  # fmt: skip
NUMBER_FUNCTIONS = [  # the functions returning a size, a rank or rank lists
    "_get_data_parallel_world_size", "_get_data_parallel_rank", "_get_data_parallel_group_ranks",
    "get_data_parallel_world_size", "get_data_parallel_rank", "_get_model_parallel_world_size",
    "_get_sequence_parallel_world_size", "_get_sequence_parallel_rank",
    "_get_sequence_data_parallel_world_size", "_get_sequence_data_parallel_rank",
    "_get_broadcast_src_rank", "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank",
    "get_model_parallel_world_size", "get_model_parallel_rank", "_get_max_expert_size",
]  # fmt: skip
EXPERT_FUNCTIONS = [  # f(group_name)
    "_get_expert_parallel_group_ranks", "_get_expert_parallel_world_size",
    "_get_expert_parallel_rank", "_get_expert_parallel_src_rank",
    "_get_expert_data_parallel_group_ranks", "_get_expert_data_parallel_world_size",
    "_get_expert_data_parallel_rank", "_get_expert_broadcast_src_rank",
]  # fmt: skip


def _members(group) -> tuple:
    """The group's global ranks, and the sum of an all-reduce of ones over it (its real size)."""
    import torch
    import torch.distributed as dist

    ones = torch.ones(1)
    dist.all_reduce(ones, group=group)
    return (dist.get_process_group_ranks(group), int(ones.item()))


def _ask_groups(layout: dict, moe: bool) -> dict:
    """Build an engine of ``layout`` and call every deepspeed.utils.groups function."""
    import torch
    from cp_train_runs import make_gpt
    from moe_models import MoENet

    import shardwise as deepspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, **layout}
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    model = MoENet(ep=2) if moe else make_gpt()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    groups = deepspeed.utils.groups
    out = {name: _members(getattr(groups, name)()) for name in GROUP_FUNCTIONS}
    out |= {name: getattr(groups, name)() for name in NUMBER_FUNCTIONS}
    try:
        out["_get_sequence_parallel_group"] = _members(groups._get_sequence_parallel_group())
    except KeyError as error:
        out["_get_sequence_parallel_group"] = f"KeyError: {error.args[0]}"
    if moe:
        name = groups._get_max_expert_size_name()
        out["name"] = name
        out |= {f: getattr(groups, f)(name) for f in EXPERT_FUNCTIONS}
        out["_get_expert_parallel_group"] = _members(groups._get_expert_parallel_group(name))
        out["_get_expert_data_parallel_group"] = _members(
            groups._get_expert_data_parallel_group(name)
        )
        out["dicts"] = sorted(groups._get_expert_parallel_group_dict()) + sorted(
            groups._get_expert_data_parallel_group_dict()
        )
    del engine
    return out


def _expect(r: int, dp: int, tp: int, cp: int, moe: bool) -> dict:
    """DeepSpeed's answers on rank ``r`` of 2 for this layout (dp x cp x tp, tp fastest)."""
    both, mine = [0, 1], [r]
    dp_ranks = both if dp == 2 else mine
    dp_cp = both if dp * cp == 2 else mine
    tp_ranks = both if tp == 2 else mine
    want = {
        "_get_data_parallel_group": (dp_ranks, dp), "get_data_parallel_group": (dp_ranks, dp),
        "_get_sequence_data_parallel_group": (dp_cp, dp * cp),
        "get_tensor_model_parallel_group": (tp_ranks, tp), "get_model_parallel_group": (tp_ranks, tp),
        "_get_data_parallel_world_size": dp, "_get_data_parallel_rank": r if dp == 2 else 0,
        "_get_data_parallel_group_ranks": dp_ranks, "get_data_parallel_world_size": dp,
        "get_data_parallel_rank": r if dp == 2 else 0, "_get_model_parallel_world_size": tp,
        "_get_sequence_parallel_world_size": cp, "_get_sequence_parallel_rank": r if cp == 2 else 0,
        "_get_sequence_data_parallel_world_size": dp * cp,
        "_get_sequence_data_parallel_rank": r if dp * cp == 2 else 0,
        "_get_broadcast_src_rank": dp_cp[0], "get_tensor_model_parallel_world_size": tp,
        "get_tensor_model_parallel_rank": r if tp == 2 else 0,
        "get_tensor_model_parallel_src_rank": tp_ranks[0], "get_model_parallel_world_size": tp,
        "get_model_parallel_rank": r if tp == 2 else 0,
        "_get_max_expert_size": 2 if moe else None,
        "_get_sequence_parallel_group": (
            (both, 2) if cp == 2 else "KeyError: No sequence parallel group found: "
            "context_parallel.size is 1 in this engine's config"
        ),
    }  # fmt: skip
    if moe:  # ep_size 2 over the 2 data ranks: one expert-parallel group, singleton expert-data
        want |= {
            "name": "ep_size_2", "_get_expert_parallel_group_ranks": both,
            "_get_expert_parallel_world_size": 2, "_get_expert_parallel_rank": r,
            "_get_expert_parallel_src_rank": 0, "_get_expert_data_parallel_group_ranks": mine,
            "_get_expert_data_parallel_world_size": 1, "_get_expert_data_parallel_rank": 0,
            "_get_expert_broadcast_src_rank": r, "_get_expert_parallel_group": (both, 2),
            "_get_expert_data_parallel_group": (mine, 1), "dicts": ["ep_size_2", "ep_size_2"],
        }  # fmt: skip
    return want


GROUP_LAYOUTS = {  # name -> (config, dp, tp, cp, moe)
    "dp2": ({}, 2, 1, 1, False),
    "tp2": ({"tensor_parallel": {"size": 2}}, 1, 2, 1, False),
    "cp2": ({"context_parallel": {"size": 2}}, 1, 1, 2, False),
    "dp2 moe ep2": ({}, 2, 1, 1, True),
}


@pytest.mark.parametrize("layout", list(GROUP_LAYOUTS))
def test_utils_groups_answer_from_the_engines_mesh(layout):
    config, dp, tp, cp, moe = GROUP_LAYOUTS[layout]
    got = run_distributed(_ask_groups, 2, config, moe)
    for rank, answers in enumerate(got):
        want = _expect(rank, dp, tp, cp, moe)
        assert set(answers) == set(want), f"{layout} rank {rank}: functions asked"
        for name, value in want.items():
            assert answers[name] == value, f"{layout} rank {rank}: {name}() = {answers[name]!r}"


def test_utils_groups_without_an_engine_says_to_initialize_first():
    import gc

    from shardwise import mesh_groups
    from shardwise.errors import EngineError

    gc.collect()  # an engine of an earlier test in this process would answer
    saved, mesh_groups._LATEST = mesh_groups._LATEST, None
    try:
        with pytest.raises(EngineError, match="call initialize first"):
            resolve("deepspeed.utils.groups._get_data_parallel_world_size")()
    finally:
        mesh_groups._LATEST = saved
