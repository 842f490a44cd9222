"""The one-process reference every layout test compares with, written once.

A test describes its run as a user describes a script to ``shardwise verify``: a
``VerifySetup`` (verify/setup.py) holding the model factory, the global batches, the
DeepSpeed-style config (``optimizer``, ``gradient_clipping``, ``bf16`` / ``fp16``, ``seed``) and
an optional ``loss_fn``. ``reference_run`` trains it in one process, one optimizer step per
global batch, and returns per step the loss and the gradient norm before clipping, and the
final parameters (fp32): what each layout's run is compared with, at the test's tolerance.

From verify it takes the setup, the batches (``setup_batches``) and the cut of a step into the
micro-batches of data ranks (``micro_batches``, its ``split`` reference for MoE gates), not
the training: verify's ``run_reference`` trains through ``shardwise.initialize`` on one
process, the right reference for a user's layout but not for tests of the engine itself
(test_dp's dp1 row would compare the engine with itself and could not fail). So the loop here
is plain PyTorch: ``torch.optim``, ``clip_grad_norm_`` and, in 16 bits, an fp32 master copy of
the weights kept by hand (the engine's policy: the model computes in 16 bits, the optimizer
steps the fp32 copies, the model gets their rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardwise.verify.setup import VerifySetup, micro_batches, take_rows
from shardwise.verify.worker import setup_batches

OPTIMIZERS = {"SGD": torch.optim.SGD, "AdamW": torch.optim.AdamW}  # the types the tests use
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NO_CLIP = 1e9  # without clipping the norm is still measured: a bound no test's norm reaches


def precision(dtype: str) -> dict:
    """The config block that trains in ``dtype`` ("fp32", "bf16" or "fp16")."""
    return {} if dtype == "fp32" else {dtype: {"enabled": True}}


def global_batches(data: Callable[[int], Any], rows: int, steps: int) -> Callable[[], list]:
    """A ``VerifySetup.batches``: ``data(rows * steps)`` drawn at once (as every test draws its
    data, so the values do not depend on the number of steps a caller slices), global batch k
    being rows [k rows, (k + 1) rows)."""

    def batches() -> list:
        every = data(rows * steps)
        return [take_rows(every, slice(k * rows, (k + 1) * rows)) for k in range(steps)]

    return batches


def _dtype(config: dict) -> torch.dtype:
    on = [k for k in ("bf16", "fp16") if config.get(k, {}).get("enabled")]
    return DTYPES[on[0]] if on else torch.float32


def _cast(batch: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor of a batch in ``dtype`` (token ids stay integers)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast(b, dtype) for b in batch)
    if isinstance(batch, Mapping):
        return {k: _cast(v, dtype) for k, v in batch.items()}
    return batch


def _loss(model: nn.Module, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    """The loss of one batch, as ``VerifySetup`` defines it: with ``loss_fn``, batch =
    (inputs, labels) and loss_fn(model(inputs), labels); without, the model's own loss of the
    batch (a mapping as keyword arguments, a tuple positionally; its ``loss`` if it has one)."""
    if loss_fn is not None:
        inputs, labels = batch
        return loss_fn(model(inputs), labels)
    if isinstance(batch, Mapping):
        out = model(**batch)
    else:
        out = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
    return getattr(out, "loss", out)


def reference_run(setup: VerifySetup, steps: int, split: int = 1) -> dict:
    """Train ``setup`` for ``steps`` global batches in one process. ``split`` > 1 cuts each
    global batch into that many accumulated micro-batches, the i-th being data rank i % dp's
    at micro-step i // dp (verify's per-rank reference: MoE gates compute over the rows one
    rank sees), each loss divided by ``split`` as the data-parallel mean divides.

    Returns ``losses`` (per step, the mean over its micro-batches), ``micro_losses`` (per
    step, each micro-batch's), ``norms`` (the global gradient norm before clipping) and
    ``params`` (the final state dict, fp32)."""
    torch.manual_seed(int(setup.config.get("seed", 0)))
    dtype = _dtype(setup.config)
    model = setup.model().to(dtype)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    block = setup.config["optimizer"]
    opt = OPTIMIZERS[block["type"]](masters, **block.get("params", {}))
    clip = setup.config.get("gradient_clipping", 0.0) or NO_CLIP
    losses, micro_losses, norms = [], [], []
    for batch in setup_batches(setup, steps):
        step = []
        for micro in micro_batches(batch, split, 1, 0):
            loss = _loss(model, _cast(micro, dtype), setup.loss_fn)
            (loss / split).backward()
            step.append(loss.item())
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, clip)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
        losses.append(sum(step) / split)
        micro_losses.append(step)
    params = {k: v.float() for k, v in model.state_dict().items()}
    return {"losses": losses, "micro_losses": micro_losses, "norms": norms, "params": params}
