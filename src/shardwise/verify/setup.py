"""The entry point a script provides to ``shardwise verify``, and how batches are cut.

The script defines a function (``shardwise_verify`` unless ``--entry`` names another) that takes
no argument and returns a ``VerifySetup`` or a dict with the same keys:

    model     () -> nn.Module, the single-process model (built once; every layout then loads
              the same initial weights into its own copy before shardwise splits it)
    batches   () -> iterable of global batches: a tensor, or a tuple / dict of tensors with
              the rows first; the same values at every call (seed your generator)
    config    the DeepSpeed-style config dict (optimizer, scheduler, clipping, precision,
              gradient_accumulation_steps, seed); verify sets the batch sizes and the layout
    loss_fn   optional (outputs, labels) -> loss, passed to ``shardwise.initialize``; without
              it the model returns its own loss from the batch
    pipeline  optional (model) -> PipelineModule built from that model's own modules (needed
              by ppN layouts; give it a ``tp_plan`` attribute for ppN x tpN)
    prepare   optional (engine) -> None, run after ``initialize`` (e.g. SyncBatchNorm groups)
"""

from __future__ import annotations

import runpy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

DEFAULT_ENTRY = "shardwise_verify"


@dataclass
class VerifySetup:
    """What a script hands ``shardwise verify`` (see the module docstring)."""

    model: Callable[[], nn.Module]
    batches: Callable[[], Iterable[Any]]
    config: dict = field(default_factory=dict)
    loss_fn: Callable[..., torch.Tensor] | None = None
    pipeline: Callable[[nn.Module], nn.Module] | None = None
    prepare: Callable[[Any], None] | None = None

    @property
    def gas(self) -> int:
        return int(self.config.get("gradient_accumulation_steps", 1))


def as_setup(value: Any, where: str) -> VerifySetup:
    """A VerifySetup from the entry point's return value; unknown or missing keys refused."""
    if isinstance(value, VerifySetup):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{where} returned {type(value).__name__}: return a dict or VerifySetup")
    known = {f.name for f in fields(VerifySetup)}
    unknown = sorted(set(value) - known)
    missing = sorted({"model", "batches"} - set(value))
    if unknown or missing:
        raise ValueError(
            f"{where}: unknown keys {unknown}, missing keys {missing}; the keys are "
            f"{sorted(known)} (docs/verify.md)"
        )
    return VerifySetup(**value)


def load_setup(
    script: str | Path, entry: str = DEFAULT_ENTRY, options: dict | None = None
) -> VerifySetup:
    """Run ``script`` as a module (not as ``__main__``: its training does not start) and call
    its entry point, with ``options`` as keyword arguments when given (``--fuzz``'s model
    options, e.g. the example GPT's MoE arguments)."""
    path = Path(script)
    if not path.is_file():
        raise ValueError(f"script {str(script)!r} not found: give the path of a training script")
    namespace = runpy.run_path(str(path), run_name=f"shardwise_verify_{path.stem}")
    fn = namespace.get(entry)
    if not callable(fn):
        raise ValueError(
            f"{path} defines no {entry}(): add a function returning the model factory, batches "
            "and config (docs/verify.md), or name yours with --entry"
        )
    return as_setup(fn(**(options or {})), f"{path}:{entry}()")


def take_rows(batch: Any, rows: slice) -> Any:
    """The same rows of every tensor of a batch (tensor, tuple/list or dict of tensors)."""
    if isinstance(batch, torch.Tensor):
        return batch[rows]
    if isinstance(batch, (tuple, list)):
        return type(batch)(take_rows(b, rows) for b in batch)
    if isinstance(batch, dict):
        return {k: take_rows(v, rows) for k, v in batch.items()}
    return batch  # a non-tensor value (a flag, a length) is the same for every row


def batch_rows(batch: Any) -> int:
    """Rows of a global batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    items = batch.values() if isinstance(batch, dict) else batch
    for b in items:
        if isinstance(b, (torch.Tensor, tuple, list, dict)):
            return batch_rows(b)
    raise ValueError("a verify batch holds no tensor: yield tensors with the rows first")


def micro_batches(batch: Any, gas: int, dp: int, dp_rank: int) -> Iterator[Any]:
    """Data rank ``dp_rank``'s micro-batches of one global batch of G rows.

    Micro-batch j of the step is rows [j G/gas, (j+1) G/gas) in one process; here data rank r
    takes the r-th of dp equal slices of it, so the union over ranks is the same micro-batch.
    """
    step_rows = batch_rows(batch)
    per_micro = step_rows // gas
    per_rank = per_micro // dp
    for j in range(gas):
        start = j * per_micro + dp_rank * per_rank
        yield take_rows(batch, slice(start, start + per_rank))
