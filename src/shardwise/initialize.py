"""``shardwise.initialize``: from a model and a config to a ready engine, in a fixed order.

    config (parsed and validated before any work) -> torch.distributed -> Topology and groups
    -> batch sizes for the data-parallel size -> unsupported features refused
    -> same weights on every rank -> optimizer -> LR scheduler -> gradient reducer
    -> data loader -> Engine -> with checkpoint.auto_resume, the newest checkpoint loaded

Everything a user can get wrong in the config fails in the first step, before a process
group or a tensor is touched.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from shardwise import comm, mesh_groups
from shardwise.config import Config, ConfigError, parse_config
from shardwise.data import build_dataloader
from shardwise.engine import Engine
from shardwise.integrations import hf_context
from shardwise.launch.env import init_distributed
from shardwise.lr_schedules import build_scheduler
from shardwise.optim import build_optimizer
from shardwise.parallel import remap
from shardwise.parallel.activation.recompute import refused_options
from shardwise.parallel.activation.selective import apply_activation_checkpointing
from shardwise.parallel.context.ulysses import check_model_heads
from shardwise.parallel.data.reducer import broadcast_parameters
from shardwise.parallel.moe.experts import bind_experts
from shardwise.parallel.pipeline import prepare as pipe
from shardwise.parallel.pipeline.prepare import stage_plan
from shardwise.parallel.strategies import build_strategy
from shardwise.parallel.strategy import StrategyContext
from shardwise.parallel.tensor.hf_styles import decoder_sequence_parallel
from shardwise.parallel.tensor.parallelize import parallelize, resolve_plan
from shardwise.parallel.tensor.placement import get_placement
from shardwise.parallel.zero.materialize import materialize_model
from shardwise.precision import LossScaler, cast_module, compute_dtype, fp16_master
from shardwise.topology import ProcessMesh, Topology, world_timeout

if TYPE_CHECKING:  # annotations only
    from torch.optim import Optimizer

    from shardwise.parallel.pipeline.train_batch import PipelineRunner

logger = logging.getLogger("shardwise")

# Without an explicit reduce_bucket_size we pick buckets small enough to overlap with
# backward (DeepSpeed's 5e8-element default would make one bucket of any model we test).


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    model_parameters: Iterable | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: dict | str | None = None,
    mesh_param: Any = None,
    config_params: dict | str | None = None,
    loss_fn: Callable | None = None,
) -> tuple[Engine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` is a dict or a JSON path (``config_params`` is the older alias; or
    ``args.deepspeed_config``). ``optimizer`` / ``lr_scheduler`` may be instances or callables
    (``optimizer(params)``, ``lr_scheduler(optimizer)``) and override the config's blocks.
    ``loss_fn(outputs, labels)`` lets ``train_batch`` work with a model that returns outputs.
    The loader of ``training_data`` is shuffled as DeepSpeed's (docs/deepspeed-compat.md)."""
    if model is None:
        raise ValueError("shardwise.initialize requires a model: initialize(model=..., config=...)")
    cfg = parse_config(_config_source(args, config, config_params))
    _refuse_unimplemented(cfg, mpu, model)
    params = remap.materialize(model_parameters)  # a generator is read once
    port, timeout = distributed_port, cfg.comms.timeout_s
    init_distributed(distributed_port=port, dist_init_required=dist_init_required, timeout=timeout)
    _configure_comms(cfg)
    model = pipe.prepare_model(cfg, model, loss_fn)
    mesh = _build_mesh(cfg, pipe.pipeline_stages(cfg, model))
    batch = cfg.resolve_batch(mesh.topology.dp)
    _log_start(cfg, mesh, batch)
    runner = pipe.bind_pipeline(cfg, model, mesh, compute_dtype(cfg), loss_fn)
    bind_experts(model, mesh)  # MoE (of the built stage): before any broadcast or reduction
    loss_fn = pipe.engine_loss(model, loss_fn)
    if mesh.topology.tp > 1:
        params = _apply_tensor_parallel(cfg, model, mesh, optimizer, runner, params)
    else:
        broadcast_parameters(model, src=mesh.dp_cp_ranks()[0], group=mesh.dp_cp_group)
    if cfg.zero_optimization.stage != 3:  # ZeRO-3 materializes a meta model shard by shard
        materialize_model(model)  # a meta model, once cut: each rank only what it keeps
    if runner is not None:
        runner.tied.broadcast()
    _apply_activation_checkpointing(cfg, model, mesh)  # after TP and PP, before the cast
    cast_module(model, compute_dtype(cfg))
    opt = _build_optimizer(cfg, model, optimizer, params)
    isolate, skip = _isolated_and_skipped(model, mesh, runner)
    strategy = build_strategy(StrategyContext(cfg, model, opt, mesh, isolate, skip))
    if opt is not None and strategy.optimizer is not None:
        opt = strategy.optimizer  # rebuilt over the master shards
    sched = _build_scheduler(cfg, opt, lr_scheduler)
    loader = _build_loader(cfg, training_data, batch, mesh, collate_fn)
    scaler = LossScaler.from_config(cfg)
    engine = Engine(model, opt, sched, strategy, mesh, cfg, batch, loader, loss_fn, scaler, runner)
    _bind_engine(engine, model)
    engine.autosave.resume(engine)  # checkpoint.auto_resume: the newest checkpoint of save_dir
    return engine, opt, loader, sched


def _bind_engine(engine: Engine, model: nn.Module) -> None:
    """What answers from the new engine: ``deepspeed.utils.groups`` (mesh_groups.py) and, for
    context parallelism on a Hugging Face model, its attention through shardwise.attention, its
    batches prepared and its loss taken over every labelled token (hf_context.py)."""
    mesh_groups.bind(engine)
    if engine.context.size > 1 and hf_context.is_hf_model(model):
        hf_context.use_context_attention(model)
        engine.context.prepare = functools.partial(hf_context.prepare_batch, model)
        engine.context.loss = hf_context.token_loss


def _isolated_and_skipped(
    model: nn.Module, mesh: ProcessMesh, runner: PipelineRunner | None
) -> tuple[list, frozenset]:
    """Parameters the strategy leaves to the pipeline's tied-weight reduction, and those the
    global norm counts elsewhere (tied copies count once, on the first stage holding them)."""
    skip = _counted_elsewhere(model, mesh)
    if runner is None:
        return [], skip
    return runner.tied.all_params(), skip | frozenset(runner.tied.counted_elsewhere)


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    given = [c for c in (config, config_params) if c is not None]
    if from_args is not None and given:
        raise ConfigError(
            "a config came both from args.deepspeed_config and from initialize(config=...): "
            "pass only one",
            key="config",
        )
    if len(given) == 2:
        raise ConfigError("pass config= or config_params=, not both", key="config")
    return from_args if from_args is not None else (given[0] if given else None)


def _build_mesh(cfg: Config, stages: int) -> ProcessMesh:
    cp = cfg.context_parallel.size
    if cp > 1 and stages > 1:
        raise ConfigError(
            f"context_parallel.size={cp} with {stages} pipeline stages is not supported: the "
            "pipeline passes whole sequences between stages; set one of them to 1",
            key="context_parallel.size",
        )
    world = comm.get_world_size()
    return ProcessMesh.create(Topology.build(world, pp=stages, tp=cfg.tensor_parallel.size, cp=cp))


def _apply_tensor_parallel(
    cfg: Config,
    model: nn.Module,
    mesh: ProcessMesh,
    optimizer: Optimizer,
    runner: Any = None,
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

    if runner is None:
        broadcast_parameters(model, src=0, group=None)
    else:
        runner.broadcast_stage()
    before = list(model.parameters())  # alive until the check: their ids stay unique
    names = remap.snapshot(model)
    plan = resolve_plan(model, cfg.tensor_parallel.plan)
    if cfg.tensor_parallel.sequence_parallel:
        plan = decoder_sequence_parallel(model, plan)
    if runner is not None:
        plan = stage_plan(model, plan, mesh)
        if not plan:  # this stage has no split layer: every TP rank runs it whole
            return model_parameters
    # With sequence parallelism, stages after the first receive the sequence already split.
    first = runner is None or runner.stage_id == 0
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


def _counted_elsewhere(model: nn.Module, mesh: ProcessMesh) -> frozenset[int]:
    """Parameters replicated across tensor-parallel ranks count in the gradient norm on
    tensor-parallel rank 0 only (each element of the model's gradient counts once)."""
    if mesh.topology.tp == 1 or mesh.tp_rank == 0:
        return frozenset()

    return frozenset(id(p) for p in model.parameters() if get_placement(p).tp_replicated)


def _configure_comms(cfg: Config) -> None:
    """The flight recorder, watchdog and fingerprint check from the ``comms`` block; a
    ``timeout_s`` that came too late (the world was set up before ``initialize``) is said."""
    block = cfg.comms
    comm.recorder().configure(
        size=block.flight_recorder,
        watchdog=block.watchdog and block.flight_recorder > 0,
        fingerprint=block.fingerprint,
        run_dir=block.run_dir,
    )
    now = world_timeout() if comm.is_initialized() else None
    if block.timeout_s is not None and now is not None and now.total_seconds() != block.timeout_s:
        logger.warning(
            "comms.timeout_s=%g has no effect: the world was set up before initialize() with a "
            "timeout of %g s; pass init_distributed(timeout=%g) or set SHARDWISE_TIMEOUT_S",
            block.timeout_s,
            now.total_seconds(),
            block.timeout_s,
        )


def _refuse_unimplemented(cfg: Config, mpu: Any, model: nn.Module | None = None) -> None:
    """Features the config validates but this version cannot run: say so, never ignore.
    Without ``model`` (verify --fuzz's check before launching), the config's rules only."""
    if cfg.context_parallel.size > 1 and model is not None:
        hf_context.refuse_built_in_attention(model)  # a model no registered attention reaches
        check_model_heads(
            model, cfg.context_parallel.size, cfg.tensor_parallel.size, cfg.context_parallel.method
        )
    todo = []
    if cfg.tensor_parallel.size > 1 and cfg.zero_optimization.stage == 3:
        todo.append("zero_optimization.stage=3 with tensor_parallel.size > 1 (use stage 1 or 2)")
    todo += _unbuilt_options(cfg)
    _refuse_conflicts(cfg)
    if mpu is not None:
        todo.append("mpu (pass tensor_parallel/pipeline sizes in the config instead)")
    if todo:
        raise ConfigError(
            f"not implemented yet in shardwise: {', '.join(todo)}. Remove or disable these "
            "keys; see docs/config.md for the status of each feature",
            key=todo[0].split("=")[0],
        )


def _refuse_conflicts(cfg: Config) -> None:
    if cfg.context_parallel.size > 1 and cfg.tensor_parallel.sequence_parallel:
        raise ConfigError(
            "tensor_parallel.sequence_parallel with context_parallel.size > 1: both split the "
            "sequence; keep context_parallel (it splits attention too) and set "
            "tensor_parallel.sequence_parallel to false",
            key="tensor_parallel.sequence_parallel",
        )
    if cfg.activation_checkpointing.partition_activations and cfg.tensor_parallel.sequence_parallel:
        raise ConfigError(
            "activation_checkpointing.partition_activations splits a block input that every "
            "tensor-parallel rank holds whole; with tensor_parallel.sequence_parallel each rank "
            "already holds only its 1/N of the sequence, so there is nothing to split. Set "
            "partition_activations to false (sequence parallelism saves that memory already)",
            key="activation_checkpointing.partition_activations",
        )


def _ensure_logging() -> None:
    """Show shardwise's INFO lines (rank 0 only logs them) unless the user configured logging."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[shardwise] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _unbuilt_options(cfg: Config) -> list[str]:
    """Options whose non-default values would change results if ignored."""
    todo = []
    comm_dtype = cfg.communication_data_type
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if comm_dtype is not None and comm_dtype != names[compute_dtype(cfg)]:
        todo.append(f"communication_data_type={comm_dtype} (reductions use the compute dtype)")

    todo += [f"activation_checkpointing.{k}" for k in refused_options(cfg.activation_checkpointing)]
    return todo


def _apply_activation_checkpointing(cfg: Config, model: nn.Module, mesh: ProcessMesh) -> None:

    block = cfg.activation_checkpointing
    # partition_activations with one TP rank: nothing to split over (DeepSpeed: the same).
    group = mesh.tp_group if block.partition_activations and mesh.topology.tp > 1 else None
    key = "activation_checkpointing.checkpoint_layers"
    apply_activation_checkpointing(model, block.checkpoint_layers, key=key, partition_group=group)
    if hasattr(model, "activation_partition"):  # a PipelineModule's activation_checkpoint_interval
        model.activation_partition.group = group


def _log_start(cfg: Config, mesh: ProcessMesh, batch: Any) -> None:
    if mesh.rank != 0:
        return
    _ensure_logging()
    clipping = cfg.gradient_clipping
    table = mesh.topology.rank_table().splitlines()
    logger.info(
        "%s; train_batch_size=%d micro=%d gas=%d; gradient_clipping=%s",
        table[0],
        batch.train_batch_size,
        batch.micro_batch_size,
        batch.gradient_accumulation_steps,
        clipping if clipping > 0 else "off",
    )
    if mesh.topology.pp * mesh.topology.tp > 1:  # model parallel: show who holds what
        logger.info("rank table:\n%s", "\n".join(table[1:]))


def _build_optimizer(
    cfg: Config, model: nn.Module, optimizer: Optimizer, model_parameters: Iterable | None
) -> torch.optim.Optimizer | None:
    params = list(model_parameters) if model_parameters is not None else None
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(params)
    if cfg.optimizer is None:
        return None

    return build_optimizer(cfg.optimizer, params, cpu_adam=fp16_master(cfg))


def _build_scheduler(cfg: Config, opt: Optimizer, lr_scheduler: Any) -> Any:
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(opt)
        if getattr(lr_scheduler, "optimizer", opt) is not opt:
            # A scheduler built on the user's optimizer must drive the rebuilt (sharded) one.
            lr_scheduler.optimizer = opt
        return lr_scheduler
    if cfg.scheduler is None or opt is None:
        return None

    return build_scheduler(cfg.scheduler, opt)


def _build_loader(
    cfg: Config, training_data: Any, batch: Any, mesh: ProcessMesh, collate_fn: Any
) -> Any:
    if training_data is None:
        return None

    return build_dataloader(
        training_data,
        micro_batch_size=batch.micro_batch_size,
        dp_rank=mesh.dp_rank,
        dp_size=mesh.topology.dp,
        gradient_accumulation_steps=batch.gradient_accumulation_steps,
        shuffle=True,
        seed=cfg.seed if cfg.seed is not None else 0,
        collate_fn=collate_fn,
        drop_last=cfg.dataloader_drop_last,
    )


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's flags: ``--deepspeed``, ``--deepspeed_config`` (and deprecated aliases)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable the engine")
    group.add_argument("--deepspeed_config", default=None, type=str, help="config JSON path")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated")
    return parser
