"""DeepSpeed's ``deepspeed.utils.groups``, answered from the mesh of the engine last built.

DeepSpeed keeps its process groups in module globals that ``initialize`` fills; scripts, and the
Hugging Face integration (``groups._get_sequence_parallel_group()`` under Ulysses), read them
back with these functions. shardwise keeps no process-group global: ``initialize`` records the
engine it returns (a weak reference, which keeps nothing alive) and every function here asks
that engine's ``ProcessMesh``. shardwise's own code never calls them; it is handed the mesh.
Before any engine, or once it is gone, they raise an EngineError saying so.

DeepSpeed's axes in shardwise's words: data parallel = the ``dp`` axis; sequence parallel = the
context axis (``context_parallel``); sequence-data parallel = data x context (``dp_cp``, what
gradients are averaged over); model parallel = tensor parallel (DeepSpeed's ``mpu`` and its
pipeline grid both mean the tensor slicing); expert groups are named ``"ep_size_<n>"``, one pair
per expert-parallel size of the model's MoE layers (parallel/moe/groups.py).
"""

from __future__ import annotations

import weakref
from typing import Any

from shardwise.errors import EngineError, NotProvidedError
from shardwise.parallel.moe.experts import moe_layers
from shardwise.parallel.moe.groups import expert_groups
from shardwise.topology import ProcessMesh

_LATEST: weakref.ref | None = None  # the engine initialize returned last: read-only for compat


def bind(engine: Any) -> None:
    """Make ``engine`` the one these functions answer for (``initialize`` calls this)."""
    global _LATEST
    _LATEST = weakref.ref(engine)


def _engine() -> Any:
    engine = _LATEST() if _LATEST is not None else None
    if engine is None:
        raise EngineError(
            "deepspeed.utils.groups answers from the engine shardwise.initialize built, and "
            "there is none (not built yet, or garbage-collected): call initialize first"
        )
    return engine


def _mesh() -> ProcessMesh:
    return _engine().mesh


# --- data, model (tensor) and sequence (context) parallelism ------------------------------------


def _get_data_parallel_group() -> Any:
    """The data-parallel group of this rank (None when not distributed)."""
    return _mesh().dp_group


def _get_data_parallel_world_size() -> int:
    return _mesh().topology.dp


def _get_data_parallel_rank() -> int:
    return _mesh().dp_rank


def _get_data_parallel_group_ranks() -> list[int]:
    return _mesh().axis_ranks("dp")


def _get_model_parallel_world_size() -> int:
    """DeepSpeed's model parallelism is the tensor slicing: the tensor-parallel size."""
    return _mesh().topology.tp


def _get_sequence_parallel_group() -> Any:
    """The context-parallel group; DeepSpeed's KeyError when the sequence is not split."""
    mesh = _mesh()
    if mesh.topology.cp == 1:
        raise KeyError(
            "No sequence parallel group found: context_parallel.size is 1 in this engine's config"
        )
    return mesh.cp_group


def _get_sequence_parallel_world_size() -> int:
    return _mesh().topology.cp


def _get_sequence_parallel_rank() -> int:
    return _mesh().cp_rank


def _get_sequence_data_parallel_group() -> Any:
    """Data x context: the ranks gradients are averaged and ZeRO shards over."""
    return _mesh().dp_cp_group


def _get_sequence_data_parallel_world_size() -> int:
    return _mesh().topology.dp_cp


def _get_sequence_data_parallel_rank() -> int:
    return _mesh().dp_cp_rank


def _get_broadcast_src_rank() -> int:
    """Global rank of the first rank of this rank's sequence-data-parallel group."""
    return _mesh().dp_cp_ranks()[0]


def get_tensor_model_parallel_group() -> Any:
    return _mesh().tp_group


def get_tensor_model_parallel_world_size() -> int:
    return _mesh().topology.tp


def get_tensor_model_parallel_rank() -> int:
    return _mesh().tp_rank


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this rank's tensor-parallel group."""
    return _mesh().axis_ranks("tp")[0]


# DeepSpeed's public AutoTP names: model parallel means tensor parallel there too.
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


# --- expert parallelism: groups named "ep_size_<n>" -----------------------------------------------


def _expert_sizes() -> list[int]:
    """The expert-parallel sizes of the engine's MoE layers, in first-use order."""
    sizes = [layer.ep_size for _, layer in moe_layers(_engine().module)]
    return list(dict.fromkeys(sizes))


def _expert(group_name: str) -> tuple[tuple[Any, list[int]], tuple[Any, list[int]]]:
    """``((ep_group, ranks), (expert_data_group, ranks))`` of an ``"ep_size_<n>"`` the model uses.

    The groups were made by initialize (bind_experts); asking again returns them, makes none."""
    names = {f"ep_size_{n}": n for n in _expert_sizes()}
    if group_name not in names:
        raise EngineError(
            f"expert parallel group {group_name!r} is not initialized: this engine's MoE layers "
            f"make {sorted(names) or 'none (the model has no MoE layer)'}"
        )
    mesh = _mesh()
    # A one-rank group is None in the mesh (its collectives are no-ops); torch reads None as
    # the whole world, so DeepSpeed's callers get a real group of this rank alone.
    return tuple(  # type: ignore[return-value]
        (group if len(ranks) > 1 else mesh.own_group(), ranks)
        for group, ranks in expert_groups(mesh, names[group_name])
    )


def _get_expert_parallel_group(group_name: str) -> Any:
    return _expert(group_name)[0][0]


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return _expert(group_name)[0][1]


def _get_expert_parallel_world_size(group_name: str) -> int:
    return len(_get_expert_parallel_group_ranks(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return _get_expert_parallel_group_ranks(group_name).index(_mesh().rank)


def _get_expert_parallel_src_rank(group_name: str) -> int:
    return _get_expert_parallel_group_ranks(group_name)[0]


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _expert(group_name)[1][0]


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return _expert(group_name)[1][1]


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return len(_get_expert_data_parallel_group_ranks(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _get_expert_data_parallel_group_ranks(group_name).index(_mesh().rank)


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    return _get_expert_data_parallel_group_ranks(group_name)[0]


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {f"ep_size_{n}": _get_expert_parallel_group(f"ep_size_{n}") for n in _expert_sizes()}


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    sizes = _expert_sizes()
    return {f"ep_size_{n}": _get_expert_data_parallel_group(f"ep_size_{n}") for n in sizes}


def _get_max_expert_size() -> int | None:
    """The largest expert-parallel size of the model's MoE layers (None: no MoE layer)."""
    return max(_expert_sizes(), default=None)


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def refused_initialize(ep_size: int = 1, mpu: object = None) -> None:
    """DeepSpeed's deprecated ``groups.initialize``, which raises there too: refused naming where
    the groups come from."""
    raise NotProvidedError(
        "deepspeed.utils.groups.initialize",
        "the groups come from the layout initialize() builds (tensor_parallel.size, "
        "pipeline.stages, context_parallel.size in the config; MoE(ep_size=...) for experts, as "
        "DeepSpeed 0.19 says); read them with the groups accessors after initialize()",
    )
