"""Features the config validates but this version cannot run: refused before any work starts,
naming the key (``initialize``'s first step after parsing; ``verify --fuzz`` calls the same
check on a config alone)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.config import Config, ConfigError
from shardwise.integrations import hf_context
from shardwise.parallel.activation.recompute import refused_options
from shardwise.parallel.context.ulysses import check_model_heads
from shardwise.precision import compute_dtype


def refuse_unimplemented(cfg: Config, mpu: Any, model: nn.Module | None = None) -> None:
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


def _unbuilt_options(cfg: Config) -> list[str]:
    """Options whose non-default values would change results if ignored."""
    todo = []
    comm_dtype = cfg.communication_data_type
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if comm_dtype is not None and comm_dtype != names[compute_dtype(cfg)]:
        todo.append(f"communication_data_type={comm_dtype} (reductions use the compute dtype)")

    todo += [f"activation_checkpointing.{k}" for k in refused_options(cfg.activation_checkpointing)]
    return todo
