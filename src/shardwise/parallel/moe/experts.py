"""Expert parallelism bound to the mesh, and the single-process vocabulary of expert state.

``bind_experts(model, mesh)`` (initialize, after the mesh): every MoE layer gets its
expert-parallel group (for the all-to-all and the no-drop capacity) and its rank in it, and
every expert parameter its expert-data group (data/replica_groups.py): the strategies reduce,
broadcast and shard it there.

Names: expert ``i`` of expert-parallel rank ``r`` is ``deepspeed_experts.<r * L + i>`` in the
model built with ``ep_size=1``. ``global_state`` turns a state dict with local expert names into
that vocabulary (gathering the experts over the expert-parallel group); ``global_names`` maps a
local name to that vocabulary (checkpoint pieces and whole-model loads use it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise import comm
from shardwise.parallel.data.replica_groups import set_replicas
from shardwise.parallel.moe.groups import expert_groups, expert_rank_groups
from shardwise.parallel.moe.layer import MOELayer

if TYPE_CHECKING:  # annotations only
    from shardwise.topology import ProcessMesh

_EXPERT = re.compile(r"^(?P<prefix>.*deepspeed_experts\.)(?P<i>\d+)(?P<rest>\..*)$")


def moe_layers(model: nn.Module) -> list[tuple[str, MOELayer]]:
    """``(name, layer)`` of every MoE layer, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MOELayer)]


def bind_experts(model: nn.Module, mesh: ProcessMesh) -> None:
    """Give each MoE layer its expert-parallel group and its experts their expert-data group.
    Every rank calls this together (it makes the groups); ep_size must divide the data size."""
    layers = moe_layers(model)
    topo = mesh.topology
    ep = max((m.ep_size for _, m in layers), default=1)
    if topo.pp * topo.tp > 1:  # a pipeline stage without MoE layers must refuse too
        largest = torch.tensor([ep], dtype=torch.int32)
        comm.all_reduce(largest, op=comm.ReduceOp.MAX)
        ep = int(largest.item())
    if ep > 1 and topo.pp * topo.tp > 1:
        raise NotImplementedError(
            f"MoE(ep_size={ep}) with pipeline.stages={topo.pp} and tensor_parallel.size="
            f"{topo.tp}: expert parallelism runs over data ranks only (not implemented inside "
            "a pipeline or with tensor parallelism); build the MoE layers with ep_size=1 (each "
            "rank keeps all of its layers' experts), or set pipeline.stages and "
            "tensor_parallel.size to 1"
        )
    if layers and topo.cp > 1:
        raise NotImplementedError(
            f"MoE layers with context_parallel.size={topo.cp}: expert gradients would be "
            "averaged without the context ranks; set context_parallel.size to 1"
        )
    for _, layer in layers:
        (ep_group, ep_ranks), (edp_group, edp_ranks) = expert_groups(mesh, layer.ep_size)
        data = set(mesh.axis_ranks("dp"))  # the expert-data groups of this data group
        every = [g for g in expert_rank_groups(topo, layer.ep_size)[1] if set(g) <= data]
        layer.ep_group = ep_group
        layer.gate.ep_group = ep_group
        layer.experts.ep_rank = ep_ranks.index(mesh.rank)
        layer.bound = True
        for p in layer.experts.parameters():
            set_replicas(p, edp_group, edp_ranks, every)


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's test: an expert parameter (``allreduce`` set to False by the layer)."""
    return hasattr(param, "allreduce") and not param.allreduce


def _expert_blocks(model: nn.Module) -> list[tuple[str, MOELayer]]:
    """``(prefix of deepspeed_experts., layer)`` of the layers split over several ranks."""
    return [
        (f"{n}.experts.deepspeed_experts." if n else "experts.deepspeed_experts.", m)
        for n, m in moe_layers(model)
        if m.ep_size > 1
    ]


def global_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every expert under its index in the whole layer, all experts present
    (gathered over each layer's expert-parallel group); every rank of the group must call."""
    blocks = _expert_blocks(model)
    if not blocks:
        return state
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        found = next((b for b in blocks if key.startswith(b[0])), None)
        if found is None:
            out[key] = value
            continue
        prefix, layer = found
        i, rest = key[len(prefix) :].split(".", 1)
        copies = [torch.empty_like(value) for _ in range(layer.ep_size)]
        comm.all_gather(copies, value.contiguous(), group=layer.ep_group)
        for r, t in enumerate(copies):
            out[f"{prefix}{r * layer.num_local_experts + int(i)}.{rest}"] = t
    return _expert_order(out)


def _expert_order(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Expert keys sorted by expert index (as ``ep_size=1`` lists them), the rest in place."""
    keys = list(state)
    first: dict[str, int] = {}  # a layer's experts stay where its first expert key was
    order = []
    for pos, k in enumerate(keys):
        m = _EXPERT.match(k)
        if m:
            order.append((first.setdefault(m["prefix"], pos), int(m["i"]), pos, k))
    ordered = iter(k for *_, k in sorted(order))
    return {k2: state[k2] for k2 in (next(ordered) if _EXPERT.match(k) else k for k in keys)}


def global_names(model: nn.Module) -> Callable[[str], str]:
    """Maps a parameter or buffer name of ``model`` to its name with ``ep_size=1`` (an expert's
    local index replaced by its index in the layer; other names unchanged)."""
    blocks = _expert_blocks(model)

    def rename(name: str) -> str:
        for prefix, layer in blocks:
            if name.startswith(prefix):
                i, rest = name[len(prefix) :].split(".", 1)
                index = layer.experts.ep_rank * layer.num_local_experts + int(i)
                return f"{prefix}{index}.{rest}"
        return name

    return rename


def every_expert_name(model: nn.Module) -> set[str]:
    """The ``ep_size=1`` names of every expert of the split layers, those of other ranks too
    (a whole-model state dict or checkpoint holds them all)."""
    out = set()
    for prefix, layer in _expert_blocks(model):
        local = [n for n in layer.experts.state_dict() if n.startswith("deepspeed_experts.0.")]
        for i in range(layer.ep_size * layer.num_local_experts):
            out |= {f"{prefix}{i}.{n.split('.', 2)[2]}" for n in local}
    return out


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict | list | tuple, max_group_size: int | None = 178956971
) -> list[dict]:
    """DeepSpeed's: each param group split into its dense parameters and, per expert group
    name, its expert parameters (``"moe": True``, ``"name": <group_name>``)."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(
            f"param_groups must be a dict, list or tuple of dicts, not {type(param_groups).__name__}"
        )
    out = []
    for group in param_groups:
        params = list(group["params"])
        dense = {**group, "params": [p for p in params if not is_moe_param(p)]}
        out.append(dense)
        by_name: dict[str, list] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        for name, ps in by_name.items():
            out.append({**group, "params": ps, "moe": True, "name": name})
    return out
