"""``ShardwiseStrategy``: Lightning's Trainer drives a shardwise engine (docs/lightning.md).

A ``DDPStrategy`` for what Lightning already does well (starting the processes, ranks, the
distributed sampler, ``barrier``/``broadcast``/``reduce``/``all_gather`` for logging and
callbacks), with the model, the optimizer, backward, the step and checkpoints handed to
``shardwise.initialize``'s engine, in the layout the config names:

    setup_environment  torch.distributed through shardwise.init_distributed (its timeouts,
                       its hang diagnosis), with Lightning's ranks and master address
    __init__           a pipeline config refused (a LightningModule is not a list of stages)
    setup              the engine: initialize(model=the LightningModule, optimizer=what
                       configure_optimizers returns (or the config's "optimizer"), config=the
                       strategy's, with the Trainer's accumulation, clipping and precision);
                       configure_optimizers is called by initialize once the model is
                       rewritten, so it sees the layers tensor parallelism split; Lightning's
                       schedulers are pointed at the engine's optimizer (rebuilt over master
                       shards under ZeRO) and Lightning keeps stepping them
    training_step      through the engine's forward (ZeRO-3 gathers, casts, context scope)
    optimizer_step     the closure, then engine.step() (precision.py), the accumulation
                       boundary told by Lightning's loop (a short last window steps too)
    save_checkpoint    engine.save_checkpoint(path): shardwise's sharded format, with the rest
                       of Lightning's dict (loops, callbacks, schedulers) as its client state
    load_checkpoint    engine.load_checkpoint(path), after setup: any layout, any number of
                       devices; Lightning restores loops, callbacks and schedulers from it
    teardown           the engine's hooks removed; under ZeRO-3 the module gets its whole
                       weights back, so it can be used (or trained again) as any module;
                       under tensor parallelism it keeps its split layers
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

if TYPE_CHECKING:  # annotations only
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType

import shardwise
from shardwise.integrations.lightning.config import (
    engine_config,
    load_config,
    refuse_pipeline,
    storable,
)
from shardwise.integrations.lightning.precision import ShardwisePrecision


class TrainingEngine(Protocol):
    """The engine calls this strategy makes (``shardwise.initialize``'s first result)."""

    optimizer: torch.optim.Optimizer | None
    dp_world_size: int
    dp_rank: int

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor: ...

    def step(self) -> None: ...

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None: ...

    def save_checkpoint(self, save_dir: str, client_state: dict | None = None) -> Any: ...

    def load_checkpoint(
        self, load_dir: str, load_module_strict: bool = True, load_optimizer_states: bool = True
    ) -> tuple[str | None, dict | None]: ...

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]: ...

    def zero_optimization_stage(self) -> int: ...

    def bfloat16_enabled(self) -> bool: ...

    def fp16_enabled(self) -> bool: ...

    def destroy(self) -> None: ...


class ShardwiseStrategy(DDPStrategy):
    """Train a LightningModule with shardwise in the layout ``config`` names (module docstring).

    ``config``: a shardwise (DeepSpeed-keyed) config dict or JSON path; None is data
    parallelism. The Trainer decides accumulation, clipping and precision (config.py).
    """

    strategy_name = "shardwise"

    def __init__(
        self,
        config: dict | str | Path | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        refuse_pipeline(load_config(config))  # before the Trainer starts any process
        self.config = config
        self._engine: TrainingEngine | None = None
        self._failed = False

    # ------------------------------------------------------------------ precision
    @property
    def precision_plugin(self) -> ShardwisePrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, ShardwisePrecision) else ShardwisePrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # The Trainer hands its own plugin (from precision=...): keep its name, drive the engine.
        if plugin is not None and not isinstance(plugin, ShardwisePrecision):
            plugin = ShardwisePrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    @property
    def engine(self) -> TrainingEngine:
        """The shardwise engine (after ``setup``)."""
        if self._engine is None:
            raise RuntimeError("ShardwiseStrategy.engine exists once the Trainer has set it up")
        return self._engine

    # ------------------------------------------------------------------ processes
    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        env = self.cluster_environment
        assert env is not None
        os.environ.update(  # where shardwise.init_distributed (and env://) read the world
            MASTER_ADDR=env.main_address,
            MASTER_PORT=str(env.main_port),
            RANK=str(self.global_rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.num_processes),
            GROUP_RANK=str(self.node_rank),
        )
        self._process_group_backend = self._get_process_group_backend()
        shardwise.init_distributed(
            self._process_group_backend,
            distributed_port=env.main_port,
            verbose=False,
            timeout=self._timeout,
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Data ranks, not processes: tensor and pipeline ranks of a replica read alike."""
        if self._engine is None:
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        return {"num_replicas": self._engine.dp_world_size, "rank": self._engine.dp_rank}

    # ------------------------------------------------------------------ the engine
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        cfg = engine_config(
            self.config,
            trainer.accumulate_grad_batches,
            trainer.gradient_clip_val,
            _algorithm(trainer.gradient_clip_algorithm),
            str(self.precision_plugin.precision),
            _loader_batch_size(trainer),
        )
        schedulers: list = []
        optimizer = None
        if fitting and "optimizer" not in cfg:
            optimizer = functools.partial(_configured_optimizer, self.lightning_module, schedulers)
        engine, opt, _, _ = shardwise.initialize(
            model=self.lightning_module, optimizer=optimizer, config=cfg
        )
        self._engine = engine
        self.model = engine
        self.optimizers = [opt] if fitting and opt is not None else []
        self.lr_scheduler_configs = schedulers
        plugin = self.precision_plugin
        plugin.engine = engine
        plugin.input_dtype = _compute_dtype(engine)
        self._precision_plugin = plugin

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        module = model or self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and module.automatic_optimization:
            # Lightning's window, short last one of an epoch included, is the engine's.
            self.engine.set_gradient_accumulation_boundary(
                not trainer.fit_loop._should_accumulate()
            )
        return self.precision_plugin.optimizer_step(optimizer, module, closure, **kwargs)

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True  # engine.step() at every batch; it updates on the boundary only

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return {}  # the engine saves its (sharded) optimizer state itself

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine saves the model itself; engine.consolidated_state_dict() gathers it

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads into the layout it built

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restored it (resharded)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None
    ) -> None:
        """A shardwise checkpoint directory at ``filepath`` (every rank writes its shards)."""
        if storage_options is not None:
            raise TypeError("ShardwiseStrategy.save_checkpoint takes no storage_options")
        path = self.broadcast(str(filepath))
        self.engine.save_checkpoint(path, client_state=storable(checkpoint))

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict:
        """Load a shardwise checkpoint into this layout; Lightning's part of it is returned."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        strict = getattr(self.lightning_module, "strict_loading", True)
        path, client = self.engine.load_checkpoint(
            str(self.broadcast(str(checkpoint_path))),
            load_module_strict=strict,
            load_optimizer_states=fitting,
        )
        if path is None:
            raise FileNotFoundError(
                f"{checkpoint_path}: no shardwise checkpoint there (no 'latest' file); "
                "trainer.save_checkpoint under ShardwiseStrategy writes one"
            )
        return dict(client or {})

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: ``load_checkpoint`` loaded the model into the engine's layout."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: ``load_checkpoint`` loaded the optimizer state, resharded."""

    # ------------------------------------------------------------------ the end
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown then runs no collective: other ranks may be gone
        super().on_exception(exception)

    def teardown(self) -> None:
        engine, module = self._engine, self.lightning_module
        if engine is not None:
            full = None
            if engine.zero_optimization_stage() == 3 and not self._failed:
                full = engine.consolidated_state_dict()  # every rank: gathers the shards
            engine.destroy()
            if full is not None and module is not None:
                _restore_whole(module, full)
        self.model = module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """``"shardwise"`` (the config given, else data parallelism) and ZeRO 1-3 by name."""
        names = {"shardwise": None, **{f"shardwise_zero{s}": s for s in (1, 2, 3)}}
        for name, stage in names.items():
            if name in strategy_registry:
                continue
            config = {"zero_optimization": {"stage": stage}} if stage else None
            what = f"ZeRO stage {stage}" if stage else "the layout its config names"
            strategy_registry.register(name, cls, description=f"shardwise: {what}", config=config)


def _configured_optimizer(
    module: pl.LightningModule, schedulers: list, params: list
) -> torch.optim.Optimizer:
    """The one optimizer of ``configure_optimizers``, its schedulers appended to ``schedulers``.
    ``initialize`` calls it after rewriting the model, so that the optimizer holds the layers
    tensor parallelism split (built before, it would hold the replaced whole weights)."""
    optimizers, configs = _init_optimizers_and_lr_schedulers(module)
    if len(optimizers) != 1:
        raise ValueError(
            f"configure_optimizers returned {len(optimizers)} optimizers: "
            "ShardwiseStrategy trains with one (or the config's 'optimizer' block)"
        )
    schedulers.extend(configs)
    return optimizers[0]


def _algorithm(value: str | GradClipAlgorithmType | None) -> str | None:
    return None if value is None else str(getattr(value, "value", value))


def _loader_batch_size(trainer: pl.Trainer) -> int | None:
    """The batch size of a DataLoader given to ``fit`` (Lightning's private source; else None)."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    loader = getattr(source, "instance", None)
    size = getattr(loader, "batch_size", None)
    return (
        size if isinstance(loader, torch.utils.data.DataLoader) and isinstance(size, int) else None
    )


def _compute_dtype(engine: TrainingEngine) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    return torch.float16 if engine.fp16_enabled() else torch.float32


def _restore_whole(module: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Give a ZeRO-3 module its whole parameters back (the engine kept shards)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in full:
                p.data = full[name].to(device=p.device, dtype=p.dtype)
