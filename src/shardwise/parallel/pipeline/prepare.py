"""What ``initialize`` does for a pipeline, in its order: the model and the number of stages
before the mesh exists; the stage once it does (the first rewrite of phase one); the runner
after every rewrite (phase two).

Precedence (as DeepSpeed): ``PipelineModule(num_stages=...)`` wins over ``pipeline.stages``;
a PipelineModule built with ``num_stages=None`` takes the config's. ``partition_method``,
``activation_checkpoint_interval``, ``seed_layers`` and ``chunks`` given to the module win over
the config's ``pipeline.partition`` / ``activation_checkpoint_interval`` / ``seed_layers`` /
``chunks``, which fill in what the module left unset. An ``nn.Sequential`` with ``pipeline.stages > 1`` becomes
a PipelineModule of its children (same state-dict names).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise import comm
from shardwise.config import Config, ConfigError
from shardwise.parallel.pipeline.module import PipelineModule
from shardwise.parallel.pipeline.process_topology import check_layout
from shardwise.parallel.pipeline.schedule import V_SCHEDULES, placement_of
from shardwise.parallel.pipeline.train_batch import PipelineRunner
from shardwise.parallel.tensor.parallelize import pattern_regex

if TYPE_CHECKING:  # annotations only
    from shardwise.topology import ProcessMesh

logger = logging.getLogger("shardwise")


def _config_stages(cfg: Config) -> int | None:
    stages = cfg.pipeline.stages
    return None if stages in (None, "auto") else int(stages)


def pipeline_stages(cfg: Config, model: nn.Module) -> int:
    """The pipeline size of the mesh: the module's num_stages, else the config's, else 1."""
    if isinstance(model, PipelineModule) and model.num_stages is not None:
        return model.num_stages
    return _config_stages(cfg) or 1


def prepare_model(cfg: Config, model: nn.Module, loss_fn: Callable[..., Any] | None) -> nn.Module:
    """The model to train: a PipelineModule as given, an nn.Sequential wrapped when the config
    asks for stages; refuse what a pipeline cannot do, naming the key."""
    wanted = _config_stages(cfg)
    if not isinstance(model, PipelineModule) and wanted is not None and wanted > 1:
        if not isinstance(model, nn.Sequential):
            raise ConfigError(
                f"pipeline.stages={wanted} needs the model as a list of layers: pass a "
                "shardwise.pipe.PipelineModule (PipelineModule(layers=[...], loss_fn=...)) or "
                f"an nn.Sequential, not {type(model).__name__}",
                key="pipeline.stages",
            )
        model = PipelineModule(
            model,
            num_stages=wanted,
            loss_fn=loss_fn,
            chunks=cfg.pipeline.chunks,
            placement=placement_of(cfg.pipeline.schedule),
        )
    stages = pipeline_stages(cfg, model)
    if isinstance(model, PipelineModule) and wanted not in (None, stages):
        logger.info(
            "PipelineModule(num_stages=%d) takes precedence over pipeline.stages=%d", stages, wanted
        )
    if stages > 1 and cfg.zero_optimization.stage == 3:
        raise ConfigError(
            "zero_optimization.stage=3 cannot run with pipeline parallelism (each stage would "
            "gather parameters on every micro-batch); use stage 1 or 2",
            key="zero_optimization.stage",
        )
    if stages > 1:
        _check_schedule(cfg, model, stages)
    return model


def _check_schedule(cfg: Config, model: nn.Module, stages: int) -> None:
    """The chunks and micro-batches the schedule needs, refused naming the key otherwise."""
    name, gas = cfg.pipeline.schedule, cfg.gradient_accumulation_steps  # gas None: derived later
    built = isinstance(model, PipelineModule) and model.built
    chunks = getattr(model, "chunks", None) or cfg.pipeline.chunks
    if name in V_SCHEDULES and chunks != 2:
        fix = (
            f'the PipelineModule was built with chunks={chunks}: pass chunks=2, placement="v" '
            "to PipelineModule"
            if built
            else f'set "chunks": 2, not {chunks}'
        )
        raise ConfigError(
            f'pipeline.schedule="{name}" runs two model chunks per stage in a V (stage 0 holds '
            f"the first and the last): {fix}",
            key="pipeline.chunks",
        )
    if chunks > 1 and name not in ("interleaved", *V_SCHEDULES):
        raise ConfigError(
            f'pipeline.schedule="{name}" runs one model chunk per stage, but '
            f'{chunks} chunks were asked for: use "schedule": "interleaved" or chunks 1',
            key="pipeline.schedule",
        )
    if name == "interleaved" and chunks > 1 and gas is not None and gas % stages:
        raise ConfigError(
            f"gradient_accumulation_steps={gas} (the micro-batches of a step) must be a multiple "
            f"of pipeline.stages={stages} for the interleaved schedule (micro-batches go through "
            "in groups of one per stage)",
            key="gradient_accumulation_steps",
        )
    if name == "dualpipev" and gas is not None and gas < 2 * stages:
        raise ConfigError(
            f"gradient_accumulation_steps={gas} (the micro-batches of a step) must be at least "
            f"2 * pipeline.stages = {2 * stages} for the dualpipev schedule",
            key="gradient_accumulation_steps",
        )


def _fill_from_config(cfg: Config, model: PipelineModule, built_before: bool) -> None:
    pipe = cfg.pipeline
    if model.activation_checkpoint_interval == 0:
        model.activation_checkpoint_interval = pipe.activation_checkpoint_interval
    if built_before and model.partition_method is None:
        if pipe.partition.lower() not in ("parameters", "best"):
            raise ConfigError(
                f'pipeline.partition="{pipe.partition}" comes too late: the PipelineModule was '
                "partitioned by parameters when it was built; pass "
                f'partition_method="{pipe.partition}" to PipelineModule',
                key="pipeline.partition",
            )
    if built_before and pipe.chunks != model.chunks and pipe.chunks > 1:
        raise ConfigError(
            f"pipeline.chunks={pipe.chunks} comes too late: the PipelineModule was built with "
            f"chunks={model.chunks}; pass chunks={pipe.chunks} to PipelineModule",
            key="pipeline.chunks",
        )
    if pipe.seed_layers and not model.seed_layers:
        if built_before:
            raise ConfigError(
                "pipeline.seed_layers=true comes too late: the PipelineModule built its layers "
                "already; pass seed_layers=True to PipelineModule",
                key="pipeline.seed_layers",
            )
        model.seed_layers = True


def engine_loss(model: nn.Module, loss_fn: Callable[..., Any] | None) -> Any:
    """The engine's ``loss_fn``: the one given, else a PipelineModule's (in one stage the
    engine runs it as any model); never another model's ``loss_fn`` attribute (the example
    GPT holds a loss module that its own forward applies)."""
    if loss_fn is None and isinstance(model, PipelineModule) and model.loss_fn is not None:
        return model.compute_loss  # reads model.loss_fn at each call
    return loss_fn


def build_stage(cfg: Config, model: nn.Module, mesh: ProcessMesh) -> None:
    """A PipelineModule's stage for this rank, cut now if it waited for the mesh (``initialize``'s
    first rewrite); the config's pipeline keys filled in; the module's own topology checked."""
    if not isinstance(model, PipelineModule):
        return
    built_before = model.built
    _fill_from_config(cfg, model, built_before)
    t = mesh.topology
    check_layout(model._topo, {"pp": t.pp, "dp": t.dp, "tp": t.tp, "cp": t.cp})
    pp, stage = t.pp, mesh.pp_rank
    placement = placement_of(cfg.pipeline.schedule)
    if not built_before:
        model.build_stage(pp, stage, cfg.pipeline.partition, cfg.pipeline.chunks, placement)
    elif pp > 1 and model.chunks > 1 and model.placement != placement:
        raise ConfigError(
            f'pipeline.schedule="{cfg.pipeline.schedule}" places the chunks in a '
            f"{'V' if placement == 'v' else 'loop'}, but the PipelineModule was built with "
            f'placement="{model.placement}": pass placement="{placement}" to PipelineModule '
            "(or build it after initialize knows the schedule)",
            key="pipeline.schedule",
        )
    elif (model.num_stages, model.stage_id) != (pp, stage):
        raise ValueError(
            f"the PipelineModule built stage {model.stage_id} of {model.num_stages} but this "
            f"rank is stage {stage} of {pp} in the mesh: build it after init_distributed() in "
            "the same world"
        )


def build_runner(
    cfg: Config,
    model: nn.Module,
    mesh: ProcessMesh,
    dtype: torch.dtype,
    loss_fn: Callable[..., Any] | None,
) -> PipelineRunner | None:
    """The runner of the stage's schedule when there are 2 or more stages, built over the
    rewritten stage (after tensor parallelism, activation checkpointing and the cast), so its
    executor, links and tied-weight groups hold the modules that train."""
    if not isinstance(model, PipelineModule) or mesh.topology.pp == 1:
        return None
    # Sequence parallelism leaves boundary activations split along the sequence: sent whole.
    sp = cfg.tensor_parallel.sequence_parallel
    split = (cfg.pipeline.pipe_partitioned and not sp, cfg.pipeline.grad_partitioned and not sp)
    overlap = cfg.pipeline.overlap_forward_backward  # dualpipev's F&B steps
    return PipelineRunner(model, mesh, cfg.pipeline.schedule, dtype, loss_fn, split, overlap)


def stage_plan(model: nn.Module, plan: dict[str, str], mesh: ProcessMesh) -> dict[str, str]:
    """The tensor-parallel plan restricted to the patterns that name a module of this stage.

    A plan names modules of the whole model; a stage holds some of them. Each pattern must
    still match on some stage (a typo matches nowhere). A PipelineModule that saw every
    layer while building its stage knows every stage's module names, and checks alone; else
    the stages compare notes over the pipeline group. Either way every rank raises the same
    error."""

    names = [name for name, _ in model.named_modules() if name]
    here = [any(pattern_regex(p).fullmatch(n) for n in names) for p in plan]
    every = getattr(model, "all_stage_module_names", None)
    if every is not None:
        found = [
            h or any(pattern_regex(p).fullmatch(n) for n in every)
            for p, h in zip(plan, here, strict=True)
        ]
    else:
        flags = torch.tensor(here, dtype=torch.int32)
        comm.all_reduce(flags, op=comm.ReduceOp.MAX, group=mesh.pp_group)
        found = flags.tolist()
    missing = [p for p, f in zip(plan, found, strict=True) if not f]
    if missing:
        raise ValueError(
            f"tensor-parallel plan patterns {missing} (tensor_parallel.plan, or the "
            "PipelineModule's tp_plan) match no module on any pipeline stage ('*' stands for one "
            "name component; stage modules are named by layer index, e.g. '3.mlp.fc')"
        )
    return {p: style for (p, style), h in zip(plan.items(), here, strict=True) if h}
