"""Batch-size resolution: DeepSpeed's rules, with exact division instead of silent flooring.

With W the data-parallel size, tb = ``train_batch_size``, mb = ``train_micro_batch_size_per_gpu``
and gas = ``gradient_accumulation_steps``, the invariant is ``tb == mb * gas * W``. Given values
(``"auto"`` counts as not given):

=================  ======================================
given              worked out
=================  ======================================
tb, mb, gas        nothing; the invariant is checked
tb, mb             gas = tb / (mb * W)
tb, gas            mb = tb / (gas * W)
mb, gas            tb = mb * gas * W
tb                 gas = 1, mb = tb / W
mb                 gas = 1, tb = mb * W
gas or nothing     error: tb or mb is needed
=================  ======================================

DeepSpeed floors each division and then fails its product assertion (or "has to be greater than
0"); here a division that is not exact is an error that shows the arithmetic and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.config.errors import ConfigError

TB, MB, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The resolved triplet: ``train_batch_size == micro_batch_size * gradient_accumulation_steps * W``."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def resolve_batch(
    tb: int | None,
    mb: int | None,
    gas: int | None,
    dp_world_size: int,
    auto_keys: tuple[str, ...] = (),
) -> BatchSizes:
    """Work out the missing batch sizes for ``dp_world_size`` ranks by the table above.

    ``auto_keys`` names the batch keys that were ``"auto"``, so the error can say so.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ValueError(f"dp_world_size must be a positive integer, got {dp_world_size!r}")
    w = dp_world_size
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * w:
            raise ConfigError(_mismatch(tb, mb, gas, w), key=TB)
        return BatchSizes(tb, mb, gas)
    if tb is not None and mb is not None:
        return BatchSizes(tb, mb, _divide(tb, mb, w, derived=GAS, other=MB))
    if tb is not None and gas is not None:
        return BatchSizes(tb, _divide(tb, gas, w, derived=MB, other=GAS), gas)
    if mb is not None:
        gas = 1 if gas is None else gas
        return BatchSizes(mb * gas * w, mb, gas)
    if tb is not None:
        return BatchSizes(tb, _divide(tb, 1, w, derived=MB, other=None), 1)
    raise ConfigError(
        _nothing_given(auto_keys), key=TB if TB in auto_keys or MB not in auto_keys else MB
    )


def _mismatch(tb: int, mb: int, gas: int, w: int) -> str:
    return (
        f"{TB} {tb} != {MB} {mb} * {GAS} {gas} * data-parallel size {w} (= {mb * gas * w}). "
        f"DeepSpeed: {tb} != {mb} * {gas} * {w}. Fix: drop one of the three keys so that shardwise "
        f"works it out, or set {TB} to {mb * gas * w}"
    )


def _divide(tb: int, given: int, w: int, derived: str, other: str | None) -> int:
    """tb / (given * w), which must be a positive whole number; else a ConfigError with the arithmetic."""
    divisor = given * w
    if tb % divisor == 0:
        return tb // divisor
    floor = tb // divisor
    by = f"{other} {given} * data-parallel size {w}" if other else f"data-parallel size {w}"
    if other is None:
        ds_triplet = (floor, 1)  # tb only: mb = tb // W, gas = 1
    elif derived == GAS:
        ds_triplet = (given, floor)
    else:
        ds_triplet = (floor, given)
    if floor == 0:
        name = "Micro batch size per gpu" if derived == MB else "Gradient accumulation steps"
        deepspeed = f"{name}: 0 has to be greater than 0"
    else:
        deepspeed = f"{tb} != {ds_triplet[0]} * {ds_triplet[1]} * {w}"
    raise _not_divisible(tb, divisor, by, derived, deepspeed)


def _not_divisible(tb: int, divisor: int, by: str, derived: str, deepspeed: str) -> ConfigError:
    multiple = (tb // divisor + 1) * divisor
    return ConfigError(
        f"{derived} cannot be worked out: {TB} {tb} is not a multiple of {by} (= {divisor}); "
        f"{tb} / {divisor} = {tb / divisor:.4g}. DeepSpeed floors it and fails: {deepspeed}. "
        f"Fix: make {TB} a multiple of {divisor} (e.g. {multiple}), give {derived} explicitly "
        "together with the other two keys, or use a data-parallel size that divides it",
        key=derived,
    )


def _nothing_given(auto_keys: tuple[str, ...]) -> str:
    auto = [k for k in (TB, MB, GAS) if k in auto_keys]
    why = ""
    if auto:
        listed = " and ".join(auto)
        why = (
            f' ({listed} {"is" if len(auto) == 1 else "are"} "auto": shardwise does not fill in "auto" '
            "batch sizes as the Hugging Face Trainer does; give numbers, e.g. "
            f"cfg.with_values({{'{MB}': 8}}))"
        )
    return f"either {TB} or {MB} needs to be provided as a positive integer{why}"
