"""The planner: memory, communication and step time of every layout, before running anything.

    from shardwise.plan import plan
    records = plan(dims=Dims(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096),
                   cluster="a100-80g", nodes=8, global_batch=512)

``plan`` returns the same records as ``shardwise plan --json`` (evaluate.py lists the keys).
docs/planner.md explains the model and how well it predicts this machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from shardwise.plan.candidates import Layout, candidates, to_config
from shardwise.plan.cluster import PRESETS, Cluster, load
from shardwise.plan.evaluate import Planner
from shardwise.plan.memory import Options
from shardwise.plan.models import Dims, build
from shardwise.plan.shape import ModelShape, read_model

__all__ = [
    "PRESETS",
    "Cluster",
    "Dims",
    "Layout",
    "ModelShape",
    "Options",
    "Planner",
    "build",
    "candidates",
    "plan",
    "read_model",
    "to_config",
]


def plan(
    model: nn.Module | Callable[[], nn.Module] | None = None,
    dims: Dims | None = None,
    cluster: Cluster | str = "a100-80g",
    nodes: int = 1,
    procs_per_node: int | None = None,
    global_batch: int = 1,
    seq: int | None = None,
    precision: str = "bf16",
    opts: Options | None = None,
) -> list[dict[str, Any]]:
    """Every layout of ``model`` (a module, or a factory built here on the meta device) or of
    ``dims``, ranked by predicted step time; records as ``shardwise plan --json``."""
    if model is None and dims is None:
        raise ValueError("plan() needs model= (an nn.Module or a factory) or dims=")
    if dims is not None:
        shape, seq = read_model(build(dims)), seq or dims.seq
    else:
        if not isinstance(model, nn.Module):
            with torch.device("meta"):
                model = model()
        shape = read_model(model)
    if seq is None:
        raise ValueError("plan(model=...) needs seq= (tokens per sequence)")
    machine = load(cluster) if isinstance(cluster, str) else cluster
    machine = replace(machine, nodes=nodes, procs_per_node=procs_per_node or machine.procs_per_node)
    planner = Planner(shape, machine, global_batch, seq, precision, opts or Options())
    lays = candidates(shape, machine.world, machine.procs_per_node, global_batch, None, seq)
    return planner.plan(list(lays))
