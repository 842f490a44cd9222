"""``initialize``'s first phase: every rewrite of the model, before anything holds a reference
to its modules or parameters.

    stage cut (pipeline) -> expert groups bound (MoE) -> same weights on every rank, then the
    tensor-parallel split -> meta weights materialized -> activation checkpointing -> cast
    -> torch.compile of each block (``"compile": {"enabled": true}``)

The second phase (initialize.py: tied-weight groups, the pipeline's runner, optimizer, gradient
strategy, engine) sees only the rewritten modules: a part built before a rewrite would keep the
modules the rewrite replaced (a runner executing the pre-split layers while the optimizer steps
the split ones trained silently wrong twice; tests/test_preparation_order.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise.config import Config, ConfigError
from shardwise.parallel import remap
from shardwise.parallel.activation.selective import apply_activation_checkpointing
from shardwise.parallel.compile import compile_blocks
from shardwise.parallel.data.reducer import broadcast_parameters
from shardwise.parallel.moe.experts import bind_experts
from shardwise.parallel.pipeline import prepare as pipe
from shardwise.parallel.pipeline.prepare import stage_plan
from shardwise.parallel.tensor.hf_styles import decoder_sequence_parallel
from shardwise.parallel.tensor.parallelize import parallelize, resolve_plan
from shardwise.parallel.zero.materialize import materialize_model
from shardwise.precision import cast_module, compute_dtype
from shardwise.training.compiling import whole_model

if TYPE_CHECKING:  # annotations only
    from torch.optim import Optimizer

    from shardwise.topology import ProcessMesh


def rewrite_model(
    cfg: Config,
    model: nn.Module,
    mesh: ProcessMesh,
    optimizer: Optimizer | None,
    params: list | None,
) -> list | None:
    """Phase one, in the module docstring's order; the user's ``model_parameters`` list
    mapped onto the split parameters (or None)."""
    pipe.build_stage(cfg, model, mesh)  # a PipelineModule: this rank's stage, if not built
    bind_experts(model, mesh)  # MoE (of the built stage): before any broadcast or reduction
    if mesh.topology.tp > 1:
        params = apply_tensor_parallel(cfg, model, mesh, optimizer, params)
    else:
        broadcast_parameters(model, src=mesh.dp_cp_ranks()[0], group=mesh.dp_cp_group)
    if cfg.zero_optimization.stage != 3:  # ZeRO-3 materializes a meta model shard by shard
        materialize_model(model)  # a meta model, once cut: each rank only what it keeps
    apply_activation_checkpointing_block(cfg, model, mesh)  # after TP and PP, before the cast
    cast_module(model, compute_dtype(cfg))
    if cfg.compile.enabled:  # last: a region compiles what TP, checkpointing and the cast made
        compile_blocks(model, cfg.compile.backend, cfg.compile.kwargs, whole_model(cfg, model))
    return params


def apply_tensor_parallel(
    cfg: Config,
    model: nn.Module,
    mesh: ProcessMesh,
    optimizer: Optimizer,
    model_parameters: list | None = None,
) -> list | None:
    """Split the model's layers across the tensor-parallel group, from identical weights.

    Every rank first takes rank 0's whole weights (the user may not have seeded), so that the
    slices of all ranks come from one model; then the plan rewrites the layers in place.
    With a pipeline, the same within each stage, with the plan's patterns of this stage.
    The split layers get new parameters: an optimizer built beforehand would step the old,
    unused ones and leave the split layers untrained, so it is refused; a ``model_parameters``
    list (or groups) collected before the split is mapped onto the shards (parallel/remap.py),
    and returned."""

    pipelined = mesh.topology.pp > 1
    if not pipelined:
        broadcast_parameters(model, src=0, group=None)
    else:  # every rank of this stage (its data x tensor ranks) takes the stage root's weights
        group, root = mesh.stage_group()
        broadcast_parameters(model, src=root, group=group)
    before = list(model.parameters())  # alive until the check: their ids stay unique
    names = remap.snapshot(model)
    plan = resolve_plan(model, cfg.tensor_parallel.plan)
    if cfg.tensor_parallel.sequence_parallel:
        plan = decoder_sequence_parallel(model, plan)
    if pipelined:
        plan = stage_plan(model, plan, mesh)
        if not plan:  # this stage has no split layer: every TP rank runs it whole
            return model_parameters
    # With sequence parallelism, stages after the first receive the sequence already split.
    first = mesh.pp_rank == 0
    sp = cfg.tensor_parallel.sequence_parallel
    parallelize(model, plan, mesh, sequence_parallel=sp, split_entry=first)
    if model_parameters is not None:
        model_parameters = remap.remap_parameters(model_parameters, names, model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return model_parameters
    now = {id(p) for p in model.parameters()}
    replaced = {id(p) for p in before if id(p) not in now}
    stale = sum(id(p) in replaced for g in optimizer.param_groups for p in g["params"])
    if stale:
        raise ConfigError(
            f"the optimizer holds {stale} parameters that tensor parallelism replaced by their "
            "shards, so the split layers would never be updated: pass the optimizer as a "
            "callable (optimizer=lambda params: torch.optim.AdamW(params, lr=...)) or give an "
            '"optimizer" config block, so that it is built on the split model',
            key="optimizer",
        )
    return model_parameters


def apply_activation_checkpointing_block(cfg: Config, model: nn.Module, mesh: ProcessMesh) -> None:

    block = cfg.activation_checkpointing
    # partition_activations with one TP rank: nothing to split over (DeepSpeed: the same).
    group = mesh.tp_group if block.partition_activations and mesh.topology.tp > 1 else None
    key = "activation_checkpointing.checkpoint_layers"
    apply_activation_checkpointing(model, block.checkpoint_layers, key=key, partition_group=group)
    if hasattr(model, "activation_partition"):  # a PipelineModule's activation_checkpoint_interval
        model.activation_partition.group = group
