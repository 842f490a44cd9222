"""The expert-parallel and expert-data groups, inside the data axis (DeepSpeed's layout).

For expert parallelism of size ``ep``: the expert-parallel groups are ``ep`` consecutive data
ranks that split the experts between them; the expert-data groups are the data ranks holding
the same experts (strided by ``ep``), whose expert gradients are reduced together. Every
(pp, tp) coordinate has its own. The groups are made by the mesh (``ProcessMesh.group_of``).
"""

from __future__ import annotations

from typing import Any

from shardwise.topology import ProcessMesh, Topology, TopologyError


def expert_rank_groups(topology: Topology, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(expert-parallel groups, expert-data groups)`` as global-rank lists, every one."""
    dp = topology.dp
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or dp % ep:
        raise TopologyError(
            f"expert-parallel size ep_size={ep!r} must divide the data-parallel size "
            f"dp={dp}: pick an ep_size among the divisors of {dp}"
        )
    ep_groups, edp_groups = [], []
    for data in topology.axis_groups("dp"):
        ep_groups += [data[i : i + ep] for i in range(0, dp, ep)]
        edp_groups += [data[i::ep] for i in range(ep)]
    return ep_groups, edp_groups


def expert_groups(
    mesh: ProcessMesh, ep: int
) -> tuple[tuple[Any, list[int]], tuple[Any, list[int]]]:
    """``((ep_group, ep_ranks), (expert_data_group, expert_data_ranks))`` of this rank; every
    rank makes all of them, in the same order."""
    ep_groups, edp_groups = expert_rank_groups(mesh.topology, ep)
    out = {}
    for kind, groups in (("expert-parallel", ep_groups), ("expert-data", edp_groups)):
        for ranks in groups:
            group = mesh.group_of(ranks, f"{kind}:ep_size_{ep}")
            if mesh.rank in ranks:
                out[kind] = (group, ranks)
    return out["expert-parallel"], out["expert-data"]
