"""``deepspeed.DeepSpeedConfig``: a config read and validated as ``initialize`` reads it, under
DeepSpeed's attribute names, for scripts that build one to learn their batch sizes.

``world_size`` is the data-parallel size W the batch triplet is resolved for
(``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x W``):
``mpu.get_data_parallel_world_size()`` when an ``mpu`` is given; else the processes of
torch.distributed (1 before it starts) divided by the model-parallel sizes the config lays out
(``tensor_parallel.size x pipeline.stages x context_parallel.size``), which is what
``initialize`` will use. DeepSpeed without an ``mpu`` divides by the sequence-parallel size only,
so under tensor or pipeline parallelism it resolves the triplet for a W its engine does not use;
here the two agree (a documented difference, docs/deepspeed-compat.md).
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from shardwise.config.core import Config, parse_config

# DeepSpeed lower-cases the optimizer types it implements (runtime/config.py, 0.19.8)
DEEPSPEED_OPTIMIZERS = (
    "adagrad",
    "adam",
    "adamw",
    "lamb",
    "muadam",
    "muadamw",
    "musgd",
    "lion",
    "muon",
)


def data_parallel_size(cfg: Config, mpu: Any = None) -> int:
    """W of the module docstring."""
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    stages = cfg.pipeline.stages if isinstance(cfg.pipeline.stages, int) else 1
    model = cfg.tensor_parallel.size * stages * cfg.context_parallel.size
    world = dist.get_world_size()
    if world % model:
        raise ValueError(
            f"tensor_parallel.size x pipeline.stages x context_parallel.size = {model} does not "
            f"divide the world size {world}: launch a multiple of {model} processes"
        )
    return world // model


class DeepSpeedConfig:
    """DeepSpeed's ``DeepSpeedConfig(config, mpu=None)`` (the module docstring); ``.config`` is
    shardwise's own validated ``Config``. A DeepSpeed attribute not provided here raises an
    AttributeError naming it and where to read the value instead."""

    def __init__(
        self, config: dict | str | os.PathLike[str], mpu: Any = None, mesh_device: Any = None
    ) -> None:
        if mesh_device is not None:
            raise ValueError(
                "DeepSpeedConfig(mesh_device=...) is not supported: shardwise lays out the mesh "
                "from the config's tensor_parallel / pipeline / context_parallel keys"
            )
        cfg = parse_config(config)
        self.config = cfg
        self._param_dict = dict(cfg.raw)
        self.global_rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = data_parallel_size(cfg, mpu)
        sizes = cfg.resolve_batch(self.world_size)
        self.train_batch_size = sizes.train_batch_size
        self.train_micro_batch_size_per_gpu = sizes.micro_batch_size
        self.gradient_accumulation_steps = sizes.gradient_accumulation_steps
        self.steps_per_print = cfg.steps_per_print
        self.gradient_clipping = cfg.gradient_clipping
        self.zero_config = cfg.zero_optimization
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.float16_config, self.bfloat16_config = cfg.fp16, cfg.bf16
        self.fp16_enabled, self.bfloat16_enabled = cfg.fp16.enabled, cfg.bf16.enabled
        self.activation_checkpointing_config = cfg.activation_checkpointing
        self.pipeline = cfg.pipeline
        self.communication_data_type = cfg.communication_data_type
        self.wall_clock_breakdown = cfg.wall_clock_breakdown
        self.memory_breakdown = cfg.memory_breakdown
        self.dataloader_drop_last = cfg.dataloader_drop_last
        self.zero_allow_untested_optimizer = cfg.zero_allow_untested_optimizer
        opt, sched = cfg.optimizer, cfg.scheduler
        name = opt.type if opt else None
        self.optimizer_name = (
            name.lower() if name and name.lower() in DEEPSPEED_OPTIMIZERS else name
        )
        self.optimizer_params = dict(opt.params) if opt else None
        self.scheduler_name = sched.type if sched else None
        self.scheduler_params = dict(sched.params) if sched else None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"DeepSpeedConfig.{name} is not provided by shardwise: read the key from "
            "DeepSpeedConfig.config (shardwise's validated Config) or ._param_dict (the dict "
            "as given)"
        )
