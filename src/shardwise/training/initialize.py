"""``shardwise.initialize``: from a model and a config to a ready engine, in a fixed order.

    config (parsed and validated before any work; unsupported features refused: refusals.py)
    -> torch.distributed -> the model as a pipeline if asked -> mesh and groups -> batch sizes
    -> phase one, every rewrite of the model (rewrite.py: stage cut, experts bound, the same
       weights on every rank, tensor-parallel split, activation checkpointing, cast)
    -> phase two, what references the rewritten model (``_assemble``: the pipeline's runner
       and tied-weight groups, optimizer, gradient strategy, scheduler, loss scaler, Engine)
    -> data loader -> with checkpoint.auto_resume, the newest checkpoint loaded

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
from shardwise.config import BatchSizes, Config, ConfigError, parse_config
from shardwise.integrations import hf_context
from shardwise.launch.env import init_distributed
from shardwise.lr_schedules import build_scheduler
from shardwise.optim import build_optimizer
from shardwise.parallel import remap
from shardwise.parallel.pipeline import prepare as pipe
from shardwise.parallel.strategy_contract import StrategyContext
from shardwise.parallel.strategy_table import build_strategy
from shardwise.parallel.tensor.placement import get_placement
from shardwise.precision import LossScaler, compute_dtype, fp16_master
from shardwise.topology import ProcessMesh, Topology, world_timeout
from shardwise.training.data_loader import build_dataloader
from shardwise.training.engine import Engine
from shardwise.training.refusals import refuse_unimplemented
from shardwise.training.rewrite import rewrite_model

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
    refuse_unimplemented(cfg, mpu, model)
    params = remap.materialize(model_parameters)  # a generator is read once
    port, timeout = distributed_port, cfg.comms.timeout_s
    init_distributed(distributed_port=port, dist_init_required=dist_init_required, timeout=timeout)
    _configure_comms(cfg)
    model = pipe.prepare_model(cfg, model, loss_fn)
    mesh = _build_mesh(cfg, pipe.pipeline_stages(cfg, model))
    batch = cfg.resolve_batch(mesh.topology.dp)
    _log_start(cfg, mesh, batch)
    # phase one: every rewrite of the model (rewrite.py); phase two: what references it
    params = rewrite_model(cfg, model, mesh, optimizer, params)
    loader = _build_loader(cfg, training_data, batch, mesh, collate_fn)
    engine = _assemble(cfg, model, mesh, batch, optimizer, params, lr_scheduler, loader, loss_fn)
    _bind_engine(engine, model)
    engine.autosave.resume(engine)  # checkpoint.auto_resume: the newest checkpoint of save_dir
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _assemble(
    cfg: Config,
    model: nn.Module,
    mesh: ProcessMesh,
    batch: BatchSizes,
    optimizer: Any,
    params: list | None,
    lr_scheduler: Any,
    loader: Any,
    loss_fn: Callable | None,
) -> Engine:
    """Phase two, over the rewritten model: the pipeline's runner and tied-weight groups,
    the optimizer, the gradient strategy, the scheduler and loss scaler, the engine."""
    runner = pipe.build_runner(cfg, model, mesh, compute_dtype(cfg), loss_fn)
    if runner is not None:
        runner.tied.broadcast()  # every copy of a tied weight starts from its first stage's
    loss_fn = pipe.engine_loss(model, loss_fn)
    opt = _build_optimizer(cfg, model, optimizer, params)
    isolate, skip = _isolated_and_skipped(model, mesh, runner)
    strategy = build_strategy(StrategyContext(cfg, model, opt, mesh, isolate, skip))
    if opt is not None and strategy.optimizer is not None:
        opt = strategy.optimizer  # the user's, now over the master shards
    sched = _build_scheduler(cfg, opt, lr_scheduler)
    scaler = LossScaler.from_config(cfg)
    return Engine(model, opt, sched, strategy, mesh, cfg, batch, loader, loss_fn, scaler, runner)


def _bind_engine(engine: Engine, model: nn.Module) -> None:
    """What answers from the new engine: ``deepspeed.utils.groups`` (mesh_groups.py) and, for
    context parallelism on a Hugging Face model, its attention through shardwise.attention, its
    batches prepared and its loss taken over every labelled token (hf_context.py)."""
    mesh_groups.bind(engine)
    if engine.context.size > 1 and hf_context.is_hf_model(model):
        hf_context.use_context_attention(model)
        engine.context.prepare = functools.partial(hf_context.prepare_batch, model)
        engine.context.loss = hf_context.token_loss


def _counted_elsewhere(model: nn.Module, mesh: ProcessMesh) -> frozenset[int]:
    """Parameters replicated across tensor-parallel ranks count in the gradient norm on
    tensor-parallel rank 0 only (each element of the model's gradient counts once)."""
    if mesh.topology.tp == 1 or mesh.tp_rank == 0:
        return frozenset()

    return frozenset(id(p) for p in model.parameters() if get_placement(p).tp_replicated)


def _isolated_and_skipped(
    model: nn.Module, mesh: ProcessMesh, runner: PipelineRunner | None
) -> tuple[list, frozenset]:
    """Parameters the strategy leaves to the pipeline's tied-weight reduction, and those the
    global norm counts elsewhere (tied copies count once, on the first stage holding them)."""
    skip = _counted_elsewhere(model, mesh)
    if runner is None:
        return [], skip
    return runner.tied.all_params(), skip | frozenset(runner.tied.counted_elsewhere)


def _config_source(
    args: object, config: dict | str | None, config_params: dict | str | None
) -> dict | str | None:
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
    shard = cfg.zero_optimization.mics_shard  # MiCS: ZeRO shards within groups of this size
    topo = Topology.build(world, pp=stages, tp=cfg.tensor_parallel.size, cp=cp, zero_shard=shard)
    return ProcessMesh.create(topo)


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


def _ensure_logging() -> None:
    """Show shardwise's INFO lines (rank 0 only logs them) unless the user configured logging."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[shardwise] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _log_start(cfg: Config, mesh: ProcessMesh, batch: BatchSizes) -> None:
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
