"""Communication per step and per rank: every collective the library issues, as comm.py books it.

A rank's step is a list of ``Call`` s (op, axis, payload bytes, group size, calls per step);
``comm.stats()`` sums the same numbers per op, so a prediction can be compared call for call.
Sent bytes follow comm.py's ring model (rounded per call, as comm.py rounds them):
all-reduce 2 (n-1)/n S, reduce-scatter / all-gather / broadcast (n-1)/n S, send S, recv 0.

    data       DP: one all-reduce per bucket per step (on the accumulation boundary);
               ZeRO-1: reduce-scatter + all-gather per bucket per step; ZeRO-2: reduce-scatter
               every micro-batch; ZeRO-3: per unit and micro-batch an all-gather in forward,
               another in backward and a reduce-scatter, persistent units all-reduced per step;
               MiCS (zero/mics.py): gathers and reduce-scatters over the S ranks of a shard
               group, and per step one all-reduce of each bucket's (unit's) shard over the R
               replicas (axis "replicate", counted with data in ``by_axis``); hpZ
               (zero/hpz.py): per unit one all-gather over all data ranks per step, the other
               2 GAS - 1 over its secondary group of H ranks (axis "hpz", counted with data); ZeRO++
               (zero/quantized_comm.py): ``qw`` gathers each shard's int8 payload (S bytes +
               4 per 4096-element block, of 4 S in fp32), ``qg`` replaces a reduce-scatter by
               an all-to-all of N int4 chunks (S/2 bytes + 4 per 512-element block each)
    tensor     per micro-batch, at each site the trace found (activations.py): without
               sequence parallelism a column layer all-reduces its input's gradient, a row
               layer its output, the vocabulary embedding its output; with it, all-gather /
               reduce-scatter pairs instead, and the sequence-parallel weights' gradients are
               all-reduced; a vocabulary-parallel loss all-reduces N maxima and 2N sums
    expert     per MoE layer and micro-batch (ep > 1), the dispatch and the combine
               all-to-all of the (E, C, M) slots, forward and backward (a checkpoint's
               recompute: forward again): 4 x E C M bytes
    context    per attention call and micro-batch (cp > 1), ring: 2 (cp-1) K/V blocks sent
               forward, 2 (cp-1) again and 2 cp fp32 dK/dV partials backward; Ulysses: 4
               all-to-alls of one (B, H, S/cp, D) block forward, 4 backward
    tied       per step, a pipeline's tied weights (TiedLayerSpec) summed over the stages
               holding a copy (counted with pipeline in ``by_axis``)
    pipeline   per micro-batch, activations to the next stage and their gradients back (in
               1/t chunks, all-gathered by the receiving TP ranks, when TP splits them), and
               once per batch the activation's description (two int64 messages)

Scalars: the step's mean loss (train_batch), the gradient norm's partial sums (clipping or
fp16 on). Steady state: the first step adds one-off messages (split decisions) left out here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardwise.parallel.zero import blockquant as bq
from shardwise.plan.candidates import Layout
from shardwise.plan.memory import DTYPE_BYTES, Options, buckets, replica_parts, zero3_units
from shardwise.plan.shape import ParamInfo

RING = {
    "all_reduce": 2.0,
    "reduce_scatter": 1.0,
    "all_gather": 1.0,
    "broadcast": 1.0,
    "all_to_all": 1.0,
}
AXES = ("data", "tensor", "pipeline", "expert", "context")


@dataclass(frozen=True)
class Call:
    op: str
    axis: str  # data, tensor or pipeline
    payload: int  # bytes, as comm.py counts the op's payload
    n: int  # group size
    count: int = 1  # calls per step
    at_end: bool = False  # issued once the schedule's micro-batches are done (its update)

    @property
    def sent_each(self) -> int:
        if self.op == "send":
            return self.payload
        if self.op == "recv":
            return 0
        return int(round(RING[self.op] * (self.n - 1) / self.n * self.payload))

    @property
    def sent(self) -> int:
        return self.count * self.sent_each


def by_op(calls: list[Call]) -> dict[str, dict[str, int]]:
    """``{op: {"calls", "bytes", "sent_bytes"}}``: comm.stats()'s form."""
    out: dict[str, dict[str, int]] = {}
    for c in calls:
        if c.count == 0:
            continue
        e = out.setdefault(c.op, {"calls": 0, "bytes": 0, "sent_bytes": 0})
        e["calls"] += c.count
        e["bytes"] += c.count * c.payload
        e["sent_bytes"] += c.sent
    return out


def by_axis(calls: list[Call]) -> dict[str, int]:
    out = dict.fromkeys(AXES, 0)
    for c in calls:
        out["data" if c.axis in ("replicate", "hpz") else c.axis] += c.sent
    return out


def data_calls(
    params: list[ParamInfo], layout: Layout, precision: str, opts: Options, isolate: set[int]
) -> list[Call]:
    """The data-parallel gradient reduction and parameter gathers of one step, over the data
    x context ranks, an expert's over its expert-data group (memory.replica_parts)."""
    data, gas, c = layout.dp * layout.cp, layout.grad_accum, DTYPE_BYTES[precision]
    if data == 1:
        return []
    trained = [p for p in params if p.trainable]
    if layout.zero_stage == 3:
        return _zero3_calls(trained, layout, c, opts)
    stage = layout.zero_stage
    plain = stage == 0 and c == 4 and not layout.offload
    calls = []
    for k, (n, ps) in enumerate(replica_parts(trained, data)):
        if n == 1:
            continue  # no other copy: nothing to reduce
        alone = isolate if k == 0 else set()
        s = layout.shard if n == data else n  # MiCS shards the whole data group's parameters
        for lay in buckets(ps, layout.tp, s if stage >= 1 else 1, opts.bucket_elements, alone):
            size = (4 if plain else c) * lay.padded
            if stage == 0:
                calls.append(Call("all_reduce", "data", size, n))
                continue
            if s > 1:
                reduce = _reduce_call(size, lay.shard_numel, s, stage == 2 and layout.qg)
                calls.append(replace(reduce, count=gas if stage == 2 else 1))
                calls.append(Call("all_gather", "data", size, s))
            if s < n:  # MiCS: the shard, summed over its replicas once per step
                calls.append(Call("all_reduce", "replicate", c * lay.shard_numel, n // s))
    return calls


def _reduce_call(size: int, shard: int, n: int, quantized: bool) -> Call:
    """A gradient reduce-scatter of ``size`` bytes over ``n`` ranks, or ZeRO++'s int4
    all-to-all of the ``n`` chunks of ``shard`` elements that replaces it."""
    if not quantized:
        return Call("reduce_scatter", "data", size, n)
    return Call("all_to_all", "data", n * bq.payload_bytes(shard, 4, bq.GRAD_BLOCK), n)


def _zero3_calls(params: list[ParamInfo], layout: Layout, c: int, opts: Options) -> list[Call]:
    dp, gas, s = layout.dp * layout.cp, layout.grad_accum, layout.shard
    units = zero3_units(params, s, opts.persistence_threshold, opts.model_persistence_threshold)
    calls = []
    for lay, persistent in units:
        size = c * lay.padded
        if persistent:  # over all data ranks: with MiCS they span the replicas' links too
            calls.append(Call("all_reduce", "replicate" if s < dp else "data", size, dp))
            continue
        if s > 1:  # hpZ: only the first gather of a step crosses all ranks, the rest its group
            wire = s * bq.payload_bytes(lay.shard_numel, 8, bq.WEIGHT_BLOCK) if layout.qw else size
            inside = 2 * gas - 1 if layout.hpz > 1 else 0
            calls.append(Call("all_gather", "data", wire, s, 2 * gas - inside))
            calls += [Call("all_gather", "hpz", size, layout.hpz, inside)] if inside else []
            calls.append(replace(_reduce_call(size, lay.shard_numel, s, layout.qg), count=gas))
        if s < dp:  # MiCS: the shard, summed over its replicas once per step
            calls.append(Call("all_reduce", "replicate", c * lay.shard_numel, dp // s))
    return calls


# (forward ops, backward ops) of each traced site, without and with sequence parallelism.
SITE_OPS = {
    ("col_in", False): ([], ["all_reduce"]),
    ("col_in", True): (["all_gather"], ["reduce_scatter"]),
    ("row_out", False): (["all_reduce"], []),
    ("row_out", True): (["reduce_scatter"], ["all_gather"]),
}


def tensor_calls(
    sites: list[tuple[str, int]],
    sp_params: list[ParamInfo],
    layout: Layout,
    precision: str,
    split_entry: bool,
    forward_only: bool = False,
) -> list[Call]:
    """The tensor-parallel collectives of one step, from the stage's traced sites
    (``forward_only``: a checkpoint's recompute, which runs forward ops again)."""
    tp, gas, sp = layout.tp, layout.grad_accum, layout.sequence_parallel
    if tp == 1:
        return []
    calls = []
    entered = not split_entry or forward_only
    for site, size in sites:
        if site in ("col_in", "row_out"):
            fwd, bwd = SITE_OPS[(site, sp)]
            ops = fwd if forward_only else fwd + bwd
        elif site in ("emb_out",):
            ops = ["all_reduce"]
        elif site == "rep_out":
            ops = ["all_gather"]
        elif site == "ce_rows":  # N maxima, then N sums of exp and N picked logits, in fp32
            calls += [Call("all_reduce", "tensor", 4 * size, tp, gas)]
            calls += [Call("all_reduce", "tensor", 8 * size, tp, gas)]
            continue
        elif site == "sp_in" and sp and not entered:  # the sequence split: gathered back
            entered, ops = True, ["all_gather"]
        else:
            continue
        calls += [Call(op, "tensor", size, tp, gas) for op in ops]
    if sp and not forward_only:
        c = DTYPE_BYTES[precision]
        calls += [Call("all_reduce", "tensor", c * p.numel, tp, gas) for p in sp_params]
    return calls


def expert_calls(sites: list[tuple[str, int]], layout: Layout, forward_only: bool) -> list[Call]:
    """The MoE all-to-alls of one step (module docstring) at the traced ``a2a`` sites."""
    if layout.ep == 1:
        return []
    per = 2 if forward_only else 4
    return [
        Call("all_to_all", "expert", size, layout.ep, per * layout.grad_accum)
        for site, size in sites
        if site == "a2a"
    ]


def context_calls(
    sites: list[tuple[str, int]], layout: Layout, precision: str, forward_only: bool
) -> list[Call]:
    """Context parallelism's traffic of one step at the traced attention calls (``attn``:
    the bytes of one (B, H, S/cp, D) query block; module docstring)."""
    cp, gas = layout.cp, layout.grad_accum
    if cp == 1:
        return []
    calls = []
    for site, size in sites:
        if site != "attn":
            continue
        if layout.cp_method == "ulysses":
            calls.append(Call("all_to_all", "context", size, cp, (4 if forward_only else 8) * gas))
            continue
        blocks = 2 * (cp - 1) * gas * (1 if forward_only else 2)  # K and V, each hop
        calls += [
            Call("send", "context", size, 2, blocks),
            Call("recv", "context", size, 2, blocks),
        ]
        if not forward_only:  # the fp32 dK/dV partials travel home with their blocks
            fp32 = size * 4 // DTYPE_BYTES[precision]
            calls += [Call(op, "context", fp32, 2, 2 * cp * gas) for op in ("send", "recv")]
    return calls


def pipeline_calls(
    layout: Layout,
    stage: int,
    bytes_in: int,
    bytes_out: int,
    ndim: int,
    c: int,
    ends: tuple[bool, bool] | None = None,
) -> list[Call]:
    """Activations to the next stage, gradients to the previous one, per micro-batch; the
    description of the activation once per step; partitioned over TP when it applies.
    ``ends``: (first, last) of the model chunk when it is not the stage's own position (an
    interleaved chunk)."""
    pp, tp, gas = layout.pp, layout.tp, layout.grad_accum
    if pp == 1:
        return []
    first, last = ends if ends is not None else (stage == 0, stage == pp - 1)
    chunked = tp > 1 and not layout.sequence_parallel
    calls = []
    for size, to_next in ((bytes_out, True), (bytes_in, False)):
        if (last and to_next) or (first and not to_next):
            continue
        # With SP the boundary tensor is already 1/t of the sequence; with TP alone each TP
        # rank sends ceil(numel / t) elements of it (p2p.flat_chunk).
        wire = (
            c * -(-size // c // tp) if chunked else size // (tp if layout.sequence_parallel else 1)
        )
        calls.append(Call("send", "pipeline", wire, 2, gas))  # to_next: activations, else grads
        calls.append(Call("recv", "pipeline", wire, 2, gas))  # the opposite message
        if chunked:  # this rank all-gathers what it receives (the peer's chunks of it)
            calls.append(Call("all_gather", "tensor", size, tp, gas))
    meta = 8 * (6 + ndim)  # [split, is_tuple, count, dtype, requires_grad, ndim, *shape]
    if not last:
        calls += [Call("send", "pipeline", 8, 2), Call("send", "pipeline", meta, 2)]
    if not first:
        calls += [Call("recv", "pipeline", 8, 2), Call("recv", "pipeline", meta, 2)]
    return calls


def tied_calls(
    params: list[ParamInfo], holders: int, layout: Layout, precision: str, opts: Options
) -> list[Call]:
    """The tied weights' gradient sum over the ``holders`` stages that each hold a copy
    (pipeline/tied.py), once per step after the data-parallel reduction: the whole reduced
    gradient, or under ZeRO this rank's shard of the tied parameter's own bucket."""
    if holders < 2:
        return []
    c = DTYPE_BYTES[precision]
    plain = layout.zero_stage == 0 and c == 4 and not layout.offload
    calls = []
    for p in params:
        if layout.zero_stage == 0:
            n = 1
            for d in p.local_shape(layout.tp):
                n *= d
            calls.append(Call("all_reduce", "pipeline", (4 if plain else c) * n, holders, 1, True))
            continue
        lay = buckets([p], layout.tp, layout.shard, opts.bucket_elements, {0})[0]
        calls.append(Call("all_reduce", "pipeline", c * lay.shard_numel, holders, 1, True))
    return calls


def scalar_calls(
    layout: Layout, stage: int, precision: str, norm: bool, experts_apart: bool = False
) -> list[Call]:
    """The step's mean loss (train_batch) and the gradient norm's partial sums
    (``experts_apart``: some experts live on part of the data group, their squares summed)."""
    dp, mp = layout.dp * layout.cp, layout.pp * layout.tp
    calls = []
    last = stage == layout.pp - 1
    if dp > 1 and last:
        calls.append(Call("all_reduce", "data", 4, dp, 1, True))
    if layout.pp > 1:
        calls.append(Call("broadcast", "pipeline", 4, layout.pp, 1, True))
    if norm and layout.zero_stage >= 1 and layout.shard > 1:  # ZeRO: each rank a shard's part
        calls.append(Call("all_reduce", "data", 4, layout.shard, 1, True))  # MiCS: its shard group
    elif norm and dp > 1 and experts_apart:  # some experts on part of the data group
        calls.append(Call("all_reduce", "data", 4, dp, 1, True))
    if norm and mp > 1:
        calls.append(Call("all_reduce", "pipeline" if layout.pp > 1 else "tensor", 4, mp, 1, True))
    return calls
