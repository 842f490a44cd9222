"""Every DeepSpeed name docs/deepspeed-compat.md lists resolves under shardwise and is used by a
test that checks what it does (``USED_BY``: a row without one fails here); a DeepSpeed-style
script using the deeper names trains, saves and resumes on two processes."""

from __future__ import annotations

import ast
import functools
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_distributed
from waits import scaled

from shardwise.errors import NotProvidedError

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
    if status == "refused":  # no such attribute, or (as DeepSpeed's) a function that raises
        try:
            found = resolve(name)
        except AttributeError:
            return
        with pytest.raises(NotProvidedError):
            found()
        return
    assert resolve(name) is not None, name
    module, _, attr = name.rpartition(".")
    if module != "deepspeed":  # `from deepspeed.x import y` works too
        mod = importlib.import_module("shardwise." + module.split(".", 1)[1])
        assert getattr(mod, attr) is resolve(name), name


# --- every row is used by a test ---------------------------------------------------------------

SCRIPT_RUN = "test_deepspeed_compat.py::test_a_deepspeed_style_script_using_the_deep_names_trains_and_resumes"
NAMES = "test_deepspeed_names.py::"
ALIAS = "test_deepspeed_compat.py::test_each_alias_is_the_object_it_stands_for"
GROUPS = "test_deepspeed_compat.py::test_utils_groups_answer_from_the_engines_mesh"
# Each row of the table -> the tests ("file::function") that use the name as a DeepSpeed script
# does and check what it does against DeepSpeed's documented behaviour (a return value, a side
# effect, a refusal naming the name and the alternative). Checked: every row has an entry, every
# test exists, and it mentions the name (its function, the same-file helpers and tables it
# reaches, and any tests/scripts/*.py it launches spell every part of the dotted name).
USED_BY = {
    "deepspeed.initialize": "test_engine_api.py::test_initialize_returns_the_deepspeed_four_tuple",
    "deepspeed.init_distributed": "test_launch_env.py::test_init_distributed_single_process_needs_no_launcher",
    "deepspeed.add_config_arguments": "test_engine_api.py::test_add_config_arguments",
    "deepspeed.DeepSpeedEngine": NAMES + "test_initialize_returns_a_deepspeed_engine_that_is_a_module",
    "deepspeed.comm": SCRIPT_RUN,
    "deepspeed.comm.get_rank": SCRIPT_RUN,
    "deepspeed.comm.get_world_size": SCRIPT_RUN,
    "deepspeed.comm.get_local_rank": SCRIPT_RUN,
    "deepspeed.comm.barrier": SCRIPT_RUN,
    "deepspeed.comm.all_reduce": SCRIPT_RUN,
    "deepspeed.comm.configure": SCRIPT_RUN,
    "deepspeed.comm.log_summary": SCRIPT_RUN,
    "deepspeed.accelerator.get_accelerator": NAMES + "test_get_accelerator_is_one_object_and_set_accelerator_replaces_it",
    "deepspeed.accelerator.real_accelerator.get_accelerator": NAMES + "test_get_accelerator_is_one_object_and_set_accelerator_replaces_it",
    "deepspeed.accelerator.set_accelerator": NAMES + "test_get_accelerator_is_one_object_and_set_accelerator_replaces_it",
    "deepspeed.runtime.utils.set_random_seed": NAMES + "test_set_random_seed_seeds_python_numpy_and_torch_as_deepspeed",
    "deepspeed.runtime.utils.see_memory_usage": (NAMES + "test_see_memory_usage_prints_deepspeeds_report_and_restarts_the_peak", SCRIPT_RUN),
    "deepspeed.runtime.engine.DeepSpeedEngine": NAMES + "test_initialize_returns_a_deepspeed_engine_that_is_a_module",
    "deepspeed.runtime.dataloader.RepeatingLoader": NAMES + "test_repeating_loader_restarts_its_loader_endlessly",
    "deepspeed.runtime.lr_schedules.WarmupLR": "test_scheduler_defaults.py::test_lr_sequence_is_deepspeeds",
    "deepspeed.runtime.lr_schedules.WarmupDecayLR": "test_scheduler_defaults.py::test_lr_sequence_is_deepspeeds",
    "deepspeed.runtime.lr_schedules.WarmupCosineLR": "test_scheduler_defaults.py::test_lr_sequence_is_deepspeeds",
    "deepspeed.runtime.lr_schedules.OneCycle": "test_scheduler_defaults.py::test_lr_sequence_is_deepspeeds",
    "deepspeed.runtime.lr_schedules.LRRangeTest": "test_scheduler_defaults.py::test_lr_sequence_is_deepspeeds",
    "deepspeed.runtime.pipe.PipelineModule": ALIAS,
    "deepspeed.runtime.pipe.LayerSpec": ALIAS,
    "deepspeed.runtime.pipe.TiedLayerSpec": ALIAS,
    "deepspeed.runtime.pipe.module.PipelineModule": ALIAS,
    "deepspeed.pipe.PipelineModule": "test_pipe_equivalence.py::test_pipeline_trains_like_one_process",
    "deepspeed.pipe.LayerSpec": "test_pipe_module.py::test_one_stage_is_the_sequential_model_same_names_same_weights",
    "deepspeed.pipe.TiedLayerSpec": "test_pipe_module.py::test_tied_layers_share_one_module_per_stage_and_a_copy_per_stage",
    "deepspeed.zero.Init": "test_zero3_init.py::test_partitioned_build_trains_like_whole_build",
    "deepspeed.zero.GatheredParameters": "test_zero3_init.py::test_gathered_parameters_with_modifier_rank",
    "deepspeed.runtime.zero.partition_parameters.Init": ALIAS,
    "deepspeed.runtime.zero.partition_parameters.GatheredParameters": ALIAS,
    "deepspeed.checkpointing.checkpoint": "test_activation_checkpointing.py::test_deepspeed_style_checkpoint_call",
    "deepspeed.checkpointing.configure": "test_partition_activations.py::test_deepspeed_configure_with_an_mpu_partitions_checkpoint_calls",
    "deepspeed.ops.adam.FusedAdam": "test_optim_defaults.py::test_fused_adam_update_matches_deepspeeds_formula",
    "deepspeed.ops.adam.DeepSpeedCPUAdam": "test_optim_defaults.py::test_fused_adam_update_matches_deepspeeds_formula",
    "deepspeed.moe.layer.MoE": "test_moe.py::test_deepspeed_names_and_utils",
    "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer": "test_moe.py::test_deepspeed_names_and_utils",
    "deepspeed.moe.utils.is_moe_param": "test_moe.py::test_deepspeed_names_and_utils",
    "deepspeed.utils.log_dist": (NAMES + "test_log_dist_without_torch_distributed_logs_here_as_rank_minus_one", SCRIPT_RUN),
    "deepspeed.utils.logger": NAMES + "test_utils_logger_carries_the_engines_lines_and_its_level_silences_them",
    "deepspeed.utils.RepeatingLoader": NAMES + "test_repeating_loader_restarts_its_loader_endlessly",
    "deepspeed.utils.groups._get_data_parallel_group": GROUPS,
    "deepspeed.utils.groups._get_data_parallel_world_size": GROUPS,
    "deepspeed.utils.groups._get_model_parallel_world_size": GROUPS,
    "deepspeed.utils.groups._get_sequence_parallel_group": GROUPS,
    "deepspeed.utils.groups._get_sequence_data_parallel_group": GROUPS,
    "deepspeed.utils.groups._get_expert_parallel_group": GROUPS,
    "deepspeed.DeepSpeedConfig": "test_deepspeed_config_view.py::test_the_attributes_scripts_read_are_deepspeeds",
    "deepspeed.runtime.config.DeepSpeedConfig": "test_deepspeed_config_view.py::test_both_paths_and_a_missing_attribute_names_itself",
    "deepspeed.runtime.pipe.topology.ProcessTopology": "test_process_topology.py::test_every_deepspeed_case",
    "deepspeed.runtime.pipe.topology.PipeDataParallelTopology": ("test_process_topology.py::test_the_two_pipeline_forms_and_their_groups", "test_process_topology.py::test_a_topology_builds_the_stages_num_stages_builds"),
    "deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology": ("test_process_topology.py::test_the_two_pipeline_forms_and_their_groups", "test_process_topology.py::test_a_topology_that_disagrees_with_the_layout_is_refused"),
    "deepspeed.ops.lamb.FusedLamb": NAMES + "test_a_refused_name_says_what_to_use_in_either_spelling",
    "deepspeed.utils.zero_to_fp32": NAMES + "test_a_refused_name_says_what_to_use_in_either_spelling",
    "deepspeed.utils.groups.initialize": NAMES + "test_groups_initialize_raises_as_deepspeeds_naming_where_the_groups_come_from",
}  # fmt: skip

# alias row -> the row it is another name for, in DeepSpeed 0.19.8 as here: the same object
ALIASES = {
    "deepspeed.runtime.pipe.PipelineModule": "deepspeed.pipe.PipelineModule",
    "deepspeed.runtime.pipe.module.PipelineModule": "deepspeed.pipe.PipelineModule",
    "deepspeed.runtime.pipe.LayerSpec": "deepspeed.pipe.LayerSpec",
    "deepspeed.runtime.pipe.TiedLayerSpec": "deepspeed.pipe.TiedLayerSpec",
    "deepspeed.runtime.zero.partition_parameters.Init": "deepspeed.zero.Init",
    "deepspeed.runtime.zero.partition_parameters.GatheredParameters": "deepspeed.zero.GatheredParameters",
}  # fmt: skip


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text))


@functools.cache
def _top_level(file: str) -> dict[str, ast.stmt]:
    """tests/``file``'s module-level statements by the names they define."""
    top: dict[str, ast.stmt] = {}
    for node in ast.parse((REPO / "tests" / file).read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            top[node.name] = node
        elif isinstance(node, ast.Assign | ast.Import | ast.ImportFrom):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name):
                    top.setdefault(sub.id, node)
                elif isinstance(sub, ast.alias):
                    top.setdefault((sub.asname or sub.name).split(".")[0], node)
    return top


def _mentioned(test_id: str) -> set[str]:
    """The words of test ``file::function``: its code (decorators too), the module-level
    functions, tables and imports it reaches, transitively, in its file and in the tests/
    helper modules it imports from, and the text of the tests/scripts/*.py they name."""
    file, function = test_id.split("::")
    tops = {file: _top_level(file)}
    assert function.startswith("test_") and function in tops[file], f"{test_id}: no such test"
    text, todo, seen = "", [(file, tops[file][function])], set()
    while todo:
        where, node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        text += ast.unparse(node) + "\n"
        if isinstance(node, ast.ImportFrom) and (REPO / "tests" / f"{node.module}.py").exists():
            helper = f"{node.module}.py"  # a tests/ helper module: follow the names taken
            tops.setdefault(helper, _top_level(helper))
            todo += [(helper, tops[helper][a.name]) for a in node.names if a.name in tops[helper]]
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        todo += [(where, tops[where][n]) for n in names if n in tops[where]]
    for script in set(re.findall(r"(\w+\.py)", text)):
        if (REPO / "tests" / "scripts" / script).exists():
            text += (REPO / "tests" / "scripts" / script).read_text()
    return _words(text)


@pytest.mark.parametrize("name, status", listed())
def test_every_row_is_used_by_a_test_that_checks_it(name, status):
    assert name in USED_BY, f"{name} ({status}): add the test that uses it to USED_BY"
    tests = USED_BY[name] if isinstance(USED_BY[name], tuple) else (USED_BY[name],)
    parts = set(name.split(".")[1:])
    for test_id in tests:
        missing = parts - _mentioned(test_id)
        assert not missing, f"{name}: {test_id} never spells {sorted(missing)}"
    if status == "alias" and ALIAS in tests:
        assert ALIASES.get(name) in USED_BY, f"{name}: ALIASES names no row it stands for"


def test_the_registry_names_only_rows():
    stale = set(USED_BY) - {name for name, _ in listed()}
    assert not stale, f"USED_BY names what the table no longer lists: {sorted(stale)}"


@pytest.mark.parametrize("alias", list(ALIASES))
def test_each_alias_is_the_object_it_stands_for(alias):
    # DeepSpeed re-exports these (deepspeed/pipe/__init__.py from runtime.pipe,
    # deepspeed/zero from runtime.zero.partition_parameters): one object, two spellings.
    target = ALIASES[alias]
    assert resolve(alias) is resolve(target), f"{alias} is not {target}"
    assert dict(listed())[target] == "works", f"{target}: the row an alias stands for"


def test_cpu_accelerator_answers_as_deepspeeds():
    from shardwise.devices.accelerators import CpuAccelerator

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
    from cp_train_runs import GPT
    from models import make_gpt
    from moe_models import MoENet

    import shardwise as deepspeed

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, **layout}
    config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    model = MoENet(ep=2) if moe else make_gpt(**GPT)
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
