"""Activation recompute behind DeepSpeed's ``deepspeed.checkpointing`` API (re-exported, under
those names, by ``shardwise.checkpointing``).

Activation checkpointing trades compute for memory: ``checkpoint(f, x)`` runs ``f`` without
keeping what ``f`` would save for backward (its intermediate activations), keeps only ``x``, and
runs ``f`` again during backward to rebuild them. For a transformer block of width C on a
(B, T) batch, forward normally saves some 15-20 tensors of B*T*C (and B*H*T*T) elements; a
checkpointed block saves its input alone, then pays one extra forward of the block in backward.

The mechanism is ``torch.utils.checkpoint`` in its non-reentrant form (it works with inputs that
do not require grad, with keyword arguments, with nested checkpoints and with ``autograd.grad``).
Random numbers are replayed, so dropout draws the same mask in the recompute as in forward:

- the default generators' states (CPU, and the device of the tensor inputs) are stashed by
  torch (``preserve_rng_state=True``);
- the tensor-parallel RNG trackers (``shardwise.parallel.tensor.random``) are stashed here: a tracker
  swaps its own state into the default generator only inside ``tracker.fork()``, so torch's
  stash does not see it. Each live tracker is set back to its state at forward for the
  recompute, then restored, so the recompute does not advance the tracker's stream either.

DeepSpeed's ``configure`` options are accepted by name. ``partition_activations`` splits the kept
inputs over the tensor-parallel group of the mpu (``shardwise.parallel.tensor.partitioned_activations``;
through ``initialize`` the group is the mesh's); moving them to host memory
(``cpu_checkpointing``) is refused with a ConfigError; the rest (CUDA-specific buffers,
synchronization, timing) has no effect. ``docs/config.md`` lists each one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from shardwise import comm
from shardwise.config import ActivationCheckpointingConfig, Config, ConfigError, parse_config
from shardwise.parallel.tensor import partitioned_activations as partitioned
from shardwise.parallel.tensor import random as tp_random

if TYPE_CHECKING:  # annotations only
    from torch.distributed import ProcessGroup

__all__ = [
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "reset",
]

_BLOCK = "activation_checkpointing"
# configure() argument -> the activation_checkpointing config key it overrides (DeepSpeed's map).
_ARGUMENT_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_checkpointing": "contiguous_memory_optimization",
    "num_checkpoints": "number_checkpoints",
    "checkpoint_in_cpu": "cpu_checkpointing",
    "synchronize": "synchronize_checkpoint_boundary",
    "profile": "profile",
}
# What configure() last set, and its mpu (DeepSpeed's API is process-wide by design: configure
# once, then the model's checkpoint() calls and model_parallel_cuda_manual_seed read it).
_state: dict[str, Any] = {"block": None, "mpu": None}


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, keeping only its inputs for backward and recomputing the
    rest there (DeepSpeed's ``deepspeed.checkpointing.checkpoint(function, *args)``).

    Results and gradients are those of the plain call, dropout included: the RNG states of
    torch and of every tensor-parallel RNG tracker are replayed for the recompute. Under
    ``torch.no_grad()`` nothing would be saved, so ``function`` simply runs. After
    ``configure(mpu, partition_activations=True)`` each rank of the mpu's tensor-parallel
    group keeps 1/N of the inputs (``shardwise.parallel.tensor.partitioned_activations``).
    """
    return run_checkpointed(function, args, kwargs, _configured_partition_group())


def run_checkpointed(
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    partition_group: ProcessGroup | None = None,
) -> Any:
    """:func:`checkpoint` with the group to partition the kept inputs over given explicitly
    (None, or a group of one rank: inputs kept whole)."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if (
        partition_group is not None
        and comm.get_world_size(partition_group) > 1
        and not partitioned.needs_plain_checkpoint(args)
    ):
        return partitioned.partitioned_checkpoint(function, partition_group, *args, **kwargs)
    at_forward = tp_random.all_tracker_states()
    calls = 0

    def run(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1 or not at_forward:  # the forward itself, or nothing to replay
            return function(*a, **kw)
        now = tp_random.all_tracker_states()
        tp_random.set_tracker_states(at_forward)  # the recompute draws what the forward drew
        try:
            return function(*a, **kw)
        finally:
            tp_random.set_tracker_states(
                now
            )  # and leaves the trackers' streams where backward found them

    return torch.utils.checkpoint.checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
    )


def _configured_partition_group() -> Any:
    """The mpu's tensor-parallel group when ``configure`` asked for partition_activations."""
    block, mpu = _state["block"], _state["mpu"]
    if block is None or not block.partition_activations or mpu is None:
        return None
    for name in ("get_tensor_model_parallel_group", "get_model_parallel_group"):
        if hasattr(mpu, name):
            return getattr(mpu, name)()
    return None


def configure(
    mpu_: Any = None,
    deepspeed_config: dict | str | os.PathLike[str] | Config | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's ``configure``: options from ``deepspeed_config``'s ``activation_checkpointing``
    block (a dict, a JSON path or a parsed Config), overridden by the arguments that are not None.

    ``mpu_`` (Megatron's model-parallel unit) gives ``model_parallel_cuda_manual_seed`` the
    tensor-parallel rank and ``partition_activations`` its group (without an mpu there is no
    tensor-parallel group: inputs are kept whole, as DeepSpeed does with one model-parallel
    rank). Raises ConfigError (naming the config key and the argument) for
    ``checkpoint_in_cpu=True``.
    """
    if isinstance(deepspeed_config, Config):
        block = deepspeed_config.activation_checkpointing
    elif deepspeed_config is not None:
        block = parse_config(deepspeed_config).activation_checkpointing
    else:
        block = ActivationCheckpointingConfig()
    given = dict(
        partition_activations=partition_activations,
        contiguous_checkpointing=contiguous_checkpointing,
        num_checkpoints=num_checkpoints,
        checkpoint_in_cpu=checkpoint_in_cpu,
        synchronize=synchronize,
        profile=profile,
    )
    overrides = {_ARGUMENT_KEYS[a]: v for a, v in given.items() if v is not None}
    # Through the config parser, so that an argument of the wrong type fails like the key would.
    block = parse_config(
        {_BLOCK: {**dataclasses.asdict(block), **overrides}}
    ).activation_checkpointing
    refused = refused_options(block)
    if refused:
        argument = {v: k for k, v in _ARGUMENT_KEYS.items()}[refused[0]]
        raise ConfigError(
            f"{_BLOCK}.{refused[0]} (configure argument {argument}) is not supported by "
            f"shardwise: {REFUSED[refused[0]]}. Leave it false",
            key=f"{_BLOCK}.{refused[0]}",
        )
    _state.update(block=block, mpu=mpu_)


# Keys whose true value asks for something shardwise does not do, and why.
REFUSED = {
    "cpu_checkpointing": "checkpointed inputs stay on the compute device (on a CPU run they "
    "already are in host memory)",
}


def refused_options(block: ActivationCheckpointingConfig) -> list[str]:
    """The keys of ``block`` set to a value shardwise refuses (see ``REFUSED``)."""
    return [key for key in REFUSED if getattr(block, key)]


def is_configured() -> bool:
    """True once ``configure`` has run (DeepSpeed's ``is_configured``)."""
    return _state["block"] is not None


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here; shardwise keeps none."""


def get_cuda_rng_tracker() -> tp_random.RNGStatesTracker:
    """The process's tensor-parallel RNG tracker; ``with get_cuda_rng_tracker().fork():`` draws
    from the per-TP-rank stream (``shardwise.parallel.tensor.random``)."""
    return tp_random.get_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int | None = None) -> None:
    """Megatron's seeding: the default stream gets ``seed`` (the same on every tensor-parallel
    rank), the tracker's "model-parallel-rng" stream ``seed + 2718 + tp_rank``.

    The TP rank is ``tp_rank`` if given (e.g. ``engine.mesh.tp_rank``), else the one of the
    mpu passed to ``configure`` (as DeepSpeed reads it), else 0 in a world of one process.
    """
    if tp_rank is None:
        tp_rank = _tp_rank(_state["mpu"])
    tp_random.model_parallel_seed(seed, tp_rank)


def _tp_rank(mpu: Any) -> int:
    for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    raise ValueError(
        "model_parallel_cuda_manual_seed(seed): the tensor-parallel rank is unknown (shardwise "
        "keeps no global model-parallel state): pass tp_rank=engine.mesh.tp_rank, or call "
        "shardwise.parallel.activation.recompute.configure(mpu) first"
    )
