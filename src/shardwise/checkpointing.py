"""``shardwise.checkpointing``: DeepSpeed's ``deepspeed.checkpointing`` surface.

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
- the tensor-parallel RNG trackers (``shardwise.parallel.random``) are stashed here: a tracker
  swaps its own state into the default generator only inside ``tracker.fork()``, so torch's
  stash does not see it. Each live tracker is set back to its state at forward for the
  recompute, then restored, so the recompute does not advance the tracker's stream either.

DeepSpeed's ``configure`` options are accepted by name; what they ask for and shardwise does not
do (partitioning checkpointed inputs over tensor-parallel ranks, moving them to host memory) is
refused with a ConfigError, the rest (CUDA-specific buffers, synchronization, timing) has no
effect. ``docs/config.md`` lists each one.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.utils.checkpoint

from shardwise.config import ActivationCheckpointingConfig, Config, ConfigError, parse_config

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
# What configure() last set (DeepSpeed's API is process-wide by design: configure once, then
# every checkpoint() call of the model reads it). No process group is kept here.
_configured: list[ActivationCheckpointingConfig] = []


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, keeping only its inputs for backward and recomputing the
    rest there (DeepSpeed's ``deepspeed.checkpointing.checkpoint(function, *args)``).

    Results and gradients are those of the plain call, dropout included: the RNG states of
    torch and of every tensor-parallel RNG tracker are replayed for the recompute. Under
    ``torch.no_grad()`` nothing would be saved, so ``function`` simply runs.
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    at_forward = _tracker_states()
    calls = 0

    def run(*a: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1 or not at_forward:  # the forward itself, or nothing to replay
            return function(*a, **kw)
        now = _tracker_states()
        _set_tracker_states(at_forward)  # the recompute draws what the forward drew
        try:
            return function(*a, **kw)
        finally:
            _set_tracker_states(now)  # and leaves the trackers' streams where backward found them

    return torch.utils.checkpoint.checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs
    )


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

    ``mpu_`` is accepted and unused: DeepSpeed reads it only to partition activations over the
    model-parallel ranks, which shardwise refuses. Raises ConfigError (naming the config key and
    the argument) for ``partition_activations=True`` and ``checkpoint_in_cpu=True``.
    """
    del mpu_  # see the docstring
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
    _configured[:] = [block]


# Keys whose true value asks for something shardwise does not do, and why.
REFUSED = {
    "partition_activations": "checkpointed inputs are not split over tensor-parallel ranks",
    "cpu_checkpointing": "checkpointed inputs stay on the compute device (on a CPU run they "
    "already are in host memory)",
}


def refused_options(block: ActivationCheckpointingConfig) -> list[str]:
    """The keys of ``block`` set to a value shardwise refuses (see ``REFUSED``)."""
    return [key for key in REFUSED if getattr(block, key)]


def is_configured() -> bool:
    """True once ``configure`` has run (DeepSpeed's ``is_configured``)."""
    return bool(_configured)


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here; shardwise keeps none."""


def get_cuda_rng_tracker() -> Any:
    """The tensor-parallel RNG tracker (``shardwise.parallel.random``), DeepSpeed's name."""
    return _require_random("get_cuda_rng_tracker").get_cuda_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int) -> Any:
    """Seed the default and the tensor-parallel generators (``shardwise.parallel.random``)."""
    return _require_random("model_parallel_cuda_manual_seed").model_parallel_cuda_manual_seed(seed)


# The coupling to shardwise.parallel.random is the functions below, importing it lazily: the
# trackers are optional, and a missing module means there is no tracker to replay.
_RANDOM = "shardwise.parallel.random"


def _random_module() -> ModuleType | None:
    try:
        return importlib.import_module(_RANDOM)
    except ModuleNotFoundError as error:
        if error.name != _RANDOM:
            raise
        return None


def _require_random(name: str) -> ModuleType:
    module = _random_module()
    if module is None or not hasattr(module, name):
        raise NotImplementedError(
            f"shardwise.checkpointing.{name} needs {_RANDOM}.{name} (the tensor-parallel RNG "
            "tracker), which this installation lacks"
        )
    return module


def _tracker_states() -> list[tuple[Any, Any]]:
    """(tracker, its states) for every live tensor-parallel RNG tracker."""
    module = _random_module()
    if module is None or not hasattr(module, "all_trackers"):
        return []
    return [(tracker, tracker.get_states()) for tracker in module.all_trackers()]


def _set_tracker_states(saved: list[tuple[Any, Any]]) -> None:
    for tracker, states in saved:
        tracker.set_states(states)
