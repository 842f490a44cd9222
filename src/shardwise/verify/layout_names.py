"""Layout names of ``shardwise verify --layouts`` and the config each one trains with.

A layout is parts joined by ``x``: ``dpN`` (data-parallel ranks), ``tpN`` (tensor-parallel
ranks), ``ppN`` (pipeline stages), ``zeroS`` (ZeRO stage S over the data ranks), ``micsN``
(with ``zeroS``: ZeRO sharded within groups of N data ranks, replicated across them), ``hpzN``
(with ``zero3``: hpZ's secondary parameter shards over groups of N data ranks), ``sp``
(sequence parallelism, with ``tpN``), ``qw`` / ``qg`` (ZeRO++'s quantized weights, with
``zero3``, / gradients, with ``zero2`` or ``zero3``: compared within verify's quantized
tolerance, compare.py), ``cpN`` (context-parallel ranks, ring attention;
``ulysses`` for DeepSpeed-Ulysses), a pipeline schedule's name (``pp2xzbv``: ``1f1b``, ``gpipe``,
``interleaved``, ``zb-h1``, ``zbv``, ``dualpipev``; otherwise the script's config decides; the
two-chunk ones get ``chunks`` 2) and a bare ``N`` (the data-parallel size, so ``zero3x2`` is
ZeRO-3 on two data ranks). The processes launched are dp x cp x tp x pp.

Every layout trains on the same global batch of G rows per step, so a data rank's micro-batch
is G / (dp x gas) rows: the mean loss over the global batch is then the mean, over data ranks,
of their micro-batch means, exactly as in one process (equal sizes make the means compose).

A model whose layers compute on the rows one rank sees, not only row by row (MoE gating:
DeepSpeed's gate takes its capacity and its balancing loss over the rank's tokens), is compared
with the one process that sees the same rows together: ``reference_for`` gives it dp x gas
micro-batches per step, micro-batch ``j dp + r`` being rank r's j-th (``split`` = dp).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from shardwise.parallel.pipeline.schedule import SCHEDULES, V_SCHEDULES

GRAMMAR = (
    "dpN, tpN, ppN, cpN, zeroS (S = 1, 2, 3), micsN, hpzN, sp, ulysses, qw, qg, a pipeline "
    "schedule "
    f"({', '.join(SCHEDULES)}), or a bare N (data ranks), joined by x"
)
EXAMPLE = "dp2,zero3x2,tp2,pp2,dp2xtp2"
NO_CLIP_NORM = 1e12  # a clipping bound never reached: the engine then measures the norm only


class LayoutError(ValueError):
    """A bad ``--layouts`` value; the message names the flag and the fix."""


@dataclass(frozen=True)
class Layout:
    """One way to run the user's setup: sizes of each axis and the ZeRO stage."""

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool = False
    cp: int = 1
    ulysses: bool = False
    split: int = 1  # one process only: each step's rows as dp ranks hold them (module doc)
    schedule: str | None = None  # the pipeline schedule; None: the script's config decides
    mics: int = 0  # MiCS: ZeRO shard groups of this many data ranks; 0: shard over all
    hpz: int = 0  # hpZ: ZeRO-3's secondary shards over groups of this many data ranks; 0: off
    compile: str | None = None  # verify --compile: the torch.compile backend of each block
    qw: bool = False  # zero_quantized_weights (ZeRO++)
    qg: bool = False  # zero_quantized_gradients (ZeRO++)

    @property
    def quantized(self) -> bool:
        """Communication quantized: not exact, compared within compare.QUANTIZED."""
        return self.qw or self.qg

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


REFERENCE = Layout("1 process")


def reference_for(layout: Layout, per_rank: bool) -> Layout:
    """The one-process run ``layout`` is compared with: REFERENCE, or for a model with
    ``per_rank`` statistics (module docstring) one that splits each step as its data ranks do."""
    if not per_rank or layout.dp == 1:
        return REFERENCE
    return Layout(f"1 process, {layout.dp} micro-batches as dp{layout.dp}", split=layout.dp)


def _part(layout: str, part: str, sizes: dict) -> None:
    if part in SCHEDULES:
        if "schedule" in sizes:
            raise LayoutError(f"--layouts: {layout!r} gives two schedules; give one")
        sizes["schedule"] = part
        return
    m = re.fullmatch(r"(dp|tp|pp|cp|zero|mics|hpz)?(\d+)|sp|ulysses|qw|qg", part)
    if m is None:
        raise LayoutError(f"--layouts: unknown part {part!r} in {layout!r}: use {GRAMMAR}")
    flag = part in ("sp", "ulysses", "qw", "qg")
    key = part if flag else (m.group(1) or "dp")
    if key in sizes:
        raise LayoutError(f"--layouts: {layout!r} gives {key} twice; give each part once")
    sizes[key] = True if flag else int(m.group(2))


def parse_layout(text: str) -> Layout:
    """``"zero3x2"`` -> Layout(dp=2, zero=3); refuses what cannot run, naming the fix."""
    sizes: dict = {}
    for part in text.lower().split("x"):
        _part(text, part, sizes)
    layout = Layout(name=text, **sizes)
    if min(layout.dp, layout.tp, layout.pp, layout.cp) < 1:
        raise LayoutError(f"--layouts: {text!r} has a size 0; every size is at least 1")
    if layout.zero not in (0, 1, 2, 3):
        raise LayoutError(f"--layouts: {text!r}: ZeRO stages are zero1, zero2 and zero3")
    if layout.zero and layout.dp == 1:
        raise LayoutError(
            f"--layouts: {text!r} shards ZeRO state over one data rank, which splits nothing: "
            f"give the data ranks, e.g. zero{layout.zero}x2"
        )
    if layout.mics and (not layout.zero or (layout.dp * layout.cp) % layout.mics):
        raise LayoutError(
            f"--layouts: {text!r}: mics{layout.mics} cuts the ZeRO shards into groups of "
            f"{layout.mics} data ranks: add zero1, zero2 or zero3 and a multiple of "
            f"{layout.mics} data ranks"
        )
    if layout.hpz and (layout.zero != 3 or layout.mics or (layout.dp * layout.cp) % layout.hpz):
        raise LayoutError(
            f"--layouts: {text!r}: hpz{layout.hpz} keeps ZeRO-3's parameter shards again over "
            f"groups of {layout.hpz} data ranks: add zero3 (not mics) and a multiple of "
            f"{layout.hpz} data ranks"
        )
    if (layout.qw and layout.zero != 3) or (layout.qg and layout.zero not in (2, 3)):
        raise LayoutError(
            f"--layouts: {text!r}: qw quantizes the ZeRO-3 parameter gathers, qg the gradient "
            "reduce-scatters of ZeRO-2 or 3; add zero3 (qw) or zero2 / zero3 (qg)"
        )
    if layout.zero == 3 and layout.pp > 1:
        raise LayoutError(f"--layouts: {text!r}: ZeRO-3 does not combine with pipelines; use zero1")
    if layout.ulysses and layout.cp == 1:
        raise LayoutError(f"--layouts: {text!r}: ulysses is a context-parallel method; add cp2")
    if layout.sp and layout.tp == 1:
        raise LayoutError(f"--layouts: {text!r}: sp splits the sequence over TP ranks; add tp2")
    if layout.schedule and layout.pp == 1:
        raise LayoutError(f"--layouts: {text!r}: {layout.schedule} schedules stages; add pp2")
    if layout.world == 1:
        raise LayoutError(f"--layouts: {text!r} is one process, the reference itself; use dp2")
    return layout


def parse_layouts(text: str) -> list[Layout]:
    """The comma-separated ``--layouts`` value, each name once."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise LayoutError(f"--layouts is empty: give names such as {EXAMPLE}")
    if len(set(names)) != len(names):
        raise LayoutError(f"--layouts {text!r} names a layout twice")
    return [parse_layout(n) for n in names]


def layout_config(base: dict, layout: Layout, global_batch: int) -> dict:
    """The script's config with the batch sizes and the layout's parallel blocks set.

    The gradient accumulation stays the script's in every layout (it is also the number of
    pipeline micro-batches), so BatchNorm statistics cover the same rows everywhere.
    """
    cfg = copy.deepcopy(base)
    gas = int(cfg.get("gradient_accumulation_steps", 1)) * layout.split
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        cfg.pop(key, None)
    cfg.update(
        train_batch_size=global_batch,
        train_micro_batch_size_per_gpu=global_batch // (gas * layout.dp),
        gradient_accumulation_steps=gas,
    )
    if not cfg.get("gradient_clipping"):
        cfg["gradient_clipping"] = NO_CLIP_NORM  # the engine reports the norm only when clipping
    # The layout's name decides each size, also over blocks the script's config already has
    # (a script written for tp2 still runs "dp2" and the reference with one TP rank).
    if layout.zero or "zero_optimization" in cfg:
        zero = {**_block(cfg, "zero_optimization"), "stage": layout.zero}
        if layout.mics or "mics_shard_size" in zero:
            zero["mics_shard_size"] = layout.mics or -1
        if layout.hpz or "zero_hpz_partition_size" in zero:
            zero["zero_hpz_partition_size"] = layout.hpz or 1
        for flag, key in (
            (layout.qw, "zero_quantized_weights"),
            (layout.qg, "zero_quantized_gradients"),
        ):
            if flag or key in zero:
                zero[key] = flag
        cfg["zero_optimization"] = zero
    if layout.tp > 1 or "tensor_parallel" in cfg:
        tp = {"size": layout.tp, "sequence_parallel": layout.sp}
        cfg["tensor_parallel"] = {**_block(cfg, "tensor_parallel"), **tp}
    if layout.pp > 1 or "pipeline" in cfg:
        cfg["pipeline"] = {**_block(cfg, "pipeline"), "stages": layout.pp}
    if layout.schedule:
        chunks = 2 if layout.schedule in (*V_SCHEDULES, "interleaved") else 1
        cfg["pipeline"].update(schedule=layout.schedule, chunks=chunks)
    if layout.compile:  # verify --compile: each block compiled (docs/compile.md)
        cfg["compile"] = {**_block(cfg, "compile"), "enabled": True, "backend": layout.compile}
    if layout.cp > 1 or "context_parallel" in cfg:
        cp = {"size": layout.cp, "method": "ulysses" if layout.ulysses else "ring"}
        cfg["context_parallel"] = {**_block(cfg, "context_parallel"), **cp}
    return cfg


def _block(cfg: dict, key: str) -> dict:
    value = cfg.get(key)
    return dict(value) if isinstance(value, dict) else {}  # DeepSpeed's `"zero_optimization": true`


def check_batch(layout: Layout, global_batch: int, gas: int) -> None:
    """Refuse before launching a layout whose data ranks cannot split the global batch evenly."""
    if global_batch % (gas * layout.dp):
        raise LayoutError(
            f"--layouts {layout.name}: the script's batches have {global_batch} rows, not a "
            f"multiple of dp {layout.dp} x gradient_accumulation_steps {gas}; yield batches of "
            f"a multiple of {gas * layout.dp} rows"
        )
