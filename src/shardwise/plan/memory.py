"""Model-state bytes per rank, from the library's own arithmetic (what memory_breakdown counts).

The parameters a rank holds are those of its pipeline stage (``partition.partition``, the
PipelineModule's cut), at their tensor-parallel local shapes, in ``parameters()`` order. The
gradient strategy is the one ``parallel/strategy_table.py`` picks, and its buffers are laid out by
the same code: ``plan_buckets`` / ``FlatLayout`` (run on meta tensors: no memory) for data
parallelism and ZeRO-1/2 buckets, the ZeRO-3 unit rule (one unit per module, parameters below
``stage3_param_persistence_threshold`` kept whole) for stage 3. With c bytes per element in
the compute dtype, P a bucket's padded size, S = P / dp its shard, K the optimizer's state
bytes per element (Adam: 8) and 4 the fp32 master:

    strategy                        params    grads     optimizer
    fp32 stage 0 (one rank / DP)    4 n       4 n       K n
    16-bit or offloaded stage 0     c P       c P       4 P (master) + K P
    ZeRO-1                          c P       c P       4 S + K S
    ZeRO-2                          c P       c S       4 S + K S
    ZeRO-3                          c S       c S       4 S + K S   (persistent units: P)

Parameters are reduced and sharded over the data x context ranks (``dp x cp``, the ``dp_cp``
group). Experts of a layer with ``ep_size`` = ep > 1 live on dp / ep of them (their
expert-data group): their buckets are laid out apart, after the others, with N = dp / ep
(``partition_by_replicas``); experts with ep = 1 share the others' buckets. A model the
planner builds with ``ep_size=1`` (``free_ep``) runs a layout's ep with E / ep local experts:
the first E / ep of each layer, as ``MoE(ep_size=ep)`` builds them.

The fp32 master is no extra memory when it is the parameters' own fp32 shard (fp32, no
offload). Offloaded, masters and states sit in host memory: counted, but not on the device.

Asynchronous checkpoints (``"checkpoint": {"async": true}``, ``Options.async_checkpoint``) keep
host staging buffers, one per piece the rank saves (checkpoint/async_save.py): a second copy of
its parameters and optimizer states (masters included), params + optimizer bytes, reused from
save to save. ``checkpoint_staging``, as ``engine.memory_breakdown()`` names it; host memory,
so not in the device's peak.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch
from torch import nn

from shardwise.parallel.flat import FlatLayout, plan_buckets
from shardwise.parallel.pipeline.partition import partition
from shardwise.parallel.strategy_contract import DEFAULT_BUCKET_ELEMENTS
from shardwise.plan.candidates import Layout
from shardwise.plan.shape import ModelShape, ParamInfo

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Options:
    """The config values the memory and traffic depend on (DeepSpeed's defaults; the bucket
    size is shardwise's default when the config leaves ``reduce_bucket_size`` out)."""

    bucket_elements: int = DEFAULT_BUCKET_ELEMENTS
    persistence_threshold: int = 100_000
    model_persistence_threshold: int = sys.maxsize
    prefetch_elements: int = 50_000_000
    max_live: int = 1_000_000_000
    optimizer_state_bytes: int = 8  # Adam / AdamW: exp_avg and exp_avg_sq in fp32
    partition_method: str = "parameters"
    async_checkpoint: bool = False  # the config's "checkpoint": {"async": true}: host staging


@dataclass(frozen=True)
class ModelStates:
    """Bytes this rank holds for its model states; ``host``: the part in host memory."""

    params: int
    grads: int
    optimizer: int
    host: int = 0
    buffers: int = 0  # transient communication buffers at their peak
    masters: int = 0  # the fp32 master copies, part of ``optimizer`` (there before any step)
    checkpoint_staging: int = 0  # host copies of params + optimizer for asynchronous saves
    secondary: int = 0  # hpZ's secondary parameter shards (zero/hpz.py), beside ``params``
    tensors: int = 0  # parameter tensors the update steps (ZeRO: its flat shards, one a bucket)

    @property
    def device(self) -> int:
        return self.params + self.grads + self.optimizer - self.host + self.secondary


def stage_bounds(shape: ModelShape, pp: int, method: str = "parameters") -> list[int]:
    """Layer boundaries of the ``pp`` stages (the PipelineModule's own partition)."""
    if pp == 1:
        return [0, len(shape.layers)]
    kinds = [layer.kind for layer in shape.layers]
    return partition(method, pp, kinds, shape.layer_counts())


def stage_params(shape: ModelShape, bounds: list[int], stage: int) -> list[ParamInfo]:
    """The parameters of ``stage`` in its module's ``parameters()`` order (tied modules first,
    as a PipelineModule registers them before its layers)."""
    return range_params(shape, [(bounds[stage], bounds[stage + 1])])


def range_params(shape: ModelShape, ranges: list[tuple[int, int]]) -> list[ParamInfo]:
    """stage_params of a stage holding the layers of ``ranges`` (two in a V placement); a
    tensor shared with a layer of another stage (a tied head) is held here too."""
    here = {i for lo, hi in ranges for i in range(lo, hi)}
    layers = [x for lo, hi in ranges for x in shape.layers[lo:hi]]
    keys = list(dict.fromkeys(x.tied for x in layers if x.tied))
    own = [p for x in layers for p in x.params if p.shared_with not in here]
    return [p for k in keys for p in shape.tied[k]] + own


def tied_params(shape: ModelShape, bounds: list[int], stage: int) -> set[int]:
    """Indices (in ``stage_params``) of parameters tied across stages (their own buckets)."""
    if len(bounds) == 2:
        return set()
    return range_tied(shape, [(bounds[stage], bounds[stage + 1])])


def range_tied(shape: ModelShape, ranges: list[tuple[int, int]]) -> set[int]:
    """tied_params of a pipelined stage holding the layers of ``ranges``."""
    keys = {x.tied for lo, hi in ranges for x in shape.layers[lo:hi] if x.tied}
    n = sum(len(shape.tied[k]) for k in keys)
    return set(range(n))


def layout_params(params: list[ParamInfo], layout: Layout, free_ep: bool) -> list[ParamInfo]:
    """``params`` as a rank of ``layout`` holds them: with ``free_ep`` (a model built with
    ep_size=1 for the planner), each MoE layer's first E / ep experts, grouped by ep."""
    if not free_ep or layout.ep == 1:
        return params
    return [
        replace(p, ep=layout.ep, experts=p.experts // layout.ep) if p.is_expert else p
        for p in params
        if not p.is_expert or p.expert < p.experts // layout.ep
    ]


def replica_parts(params: list[ParamInfo], data: int) -> list[tuple[int, list[ParamInfo]]]:
    """(ranks holding copies, params) per replica group, as ``partition_by_replicas`` splits
    them: the whole data group first, then each expert-parallel size's expert-data group."""
    out: dict[int, list[ParamInfo]] = {1: []}  # keyed by ep (1: the whole data group)
    for p in params:
        out.setdefault(p.ep if p.is_expert else 1, []).append(p)
    return [(data // ep, ps) for ep, ps in out.items() if ps]


def _parts(
    params: list[ParamInfo], layout: Layout, isolate: set[int]
) -> list[tuple[int, list[ParamInfo], set[int]]]:
    """(group size, trainable params, isolated indices) per replica group (replica_parts);
    tied parameters (pipelines, where experts are never split) are in the first one."""
    parts = replica_parts([p for p in params if p.trainable], layout.dp * layout.cp)
    return [(n, ps, isolate if k == 0 else set()) for k, (n, ps) in enumerate(parts)]


def _metas(params: list[ParamInfo], tp: int) -> list[nn.Parameter]:
    return [
        nn.Parameter(torch.empty(p.local_shape(tp), device="meta"), requires_grad=p.trainable)
        for p in params
    ]


def buckets(
    params: list[ParamInfo], tp: int, parts: int, elements: int, isolate: set[int]
) -> list[FlatLayout]:
    """The gradient strategy's buckets (ZeroStrategy's ordering: isolated ones last, alone)."""
    metas = _metas(params, tp)
    alone = {id(metas[i]): k for k, i in enumerate(sorted(isolate))}
    ordered = [m for m in metas if id(m) not in alone] + [metas[i] for i in sorted(isolate)]
    return plan_buckets(ordered, elements, parts, key=lambda m: alone.get(id(m), -1))


def zero3_units(
    params: list[ParamInfo], world: int, threshold: int, budget: int
) -> list[tuple[FlatLayout, bool]]:
    """(layout, persistent) per ZeRO-3 unit, as Zero3Strategy._plan cuts them."""
    by_module: dict[str, list[ParamInfo]] = {}
    for p in params:
        by_module.setdefault(p.module, []).append(p)
    units, persistent = [], []
    for group in by_module.values():
        sharded = []
        for p in (q for q in group if q.trainable):
            if p.numel < threshold and p.numel <= budget:
                budget -= p.numel
                persistent.append(p)
            else:
                sharded.append(p)
        if sharded:
            units.append((FlatLayout.of(_metas(sharded, 1), world), False))
    if persistent:
        units.append((FlatLayout.of(_metas(persistent, 1), 1), True))
    return units


def model_states(
    params: list[ParamInfo],
    layout: Layout,
    precision: str,
    opts: Options,
    isolate: set[int] = frozenset(),
) -> ModelStates:
    """This rank's model-state bytes (module docstring) at the optimizer step, with the
    staging of asynchronous checkpoints when ``opts.async_checkpoint``."""
    states = _states(params, layout, precision, opts, isolate)
    if not opts.async_checkpoint:
        return states
    return replace(states, checkpoint_staging=states.params + states.optimizer)


def _states(
    params: list[ParamInfo], layout: Layout, precision: str, opts: Options, isolate: set[int]
) -> ModelStates:
    c, k, tp = DTYPE_BYTES[precision], opts.optimizer_state_bytes, layout.tp
    shares = c == 4 and not layout.offload  # the fp32 master is the parameters' own shard
    master = 0 if shares else 4
    if layout.zero_stage == 0 and shares:  # LocalGradients / DataParallelReducer (any groups)
        n = sum(_numel(p.local_shape(tp)) for p in params)
        trained = sum(_numel(p.local_shape(tp)) for p in params if p.trainable)
        tensors = sum(1 for p in params if p.trainable)
        return ModelStates(4 * n, 4 * trained, k * trained, tensors=tensors)
    if layout.zero_stage == 3:
        return _zero3(params, layout, c, k, master, opts)
    data = layout.dp * layout.cp
    lays = [
        lay
        for size, ps, alone in _parts(params, layout, isolate)
        for lay in buckets(
            ps,
            tp,
            (layout.shard if size == data else size) if layout.zero_stage >= 1 else 1,
            opts.bucket_elements,
            alone,
        )
    ]
    padded = sum(lay.padded for lay in lays)
    shard = sum(lay.shard_numel for lay in lays)
    grads = c * (shard if layout.zero_stage >= 2 else padded)
    opt = (master + k) * shard
    buffers = 0
    if layout.zero_stage >= 2:  # full flat gradients of the buckets in flight (stage12.py)
        buffers = c * sum(sorted((lay.padded for lay in lays), reverse=True)[:3])
    host = opt if layout.offload else 0
    states = ModelStates(c * padded, grads, opt, host, buffers, master * shard)
    return replace(states, tensors=len(lays))  # a master per bucket (masters.py)


def _zero3(
    params: list[ParamInfo], layout: Layout, c: int, k: int, master: int, opts: Options
) -> ModelStates:
    units = zero3_units(
        params, layout.shard, opts.persistence_threshold, opts.model_persistence_threshold
    )
    held = sum(u.padded if persistent else u.shard_numel for u, persistent in units)
    frozen = sum(p.numel for p in params if not p.trainable)
    opt = (master + k) * held
    gathered = [u.padded for u, persistent in units if not persistent]
    window = min(sum(gathered), opts.prefetch_elements + max(gathered, default=0), opts.max_live)
    buffers = c * (window + 3 * max(gathered, default=0))  # gathered + reduce-scatter sends
    host = opt if layout.offload else 0
    secondary = c * sum(g // layout.hpz for g in gathered) if layout.hpz else 0  # P/H per unit
    states = ModelStates(c * held + c * frozen, c * held, opt, host, buffers, master * held)
    return replace(states, secondary=secondary, tensors=len(units))  # a master per unit


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
