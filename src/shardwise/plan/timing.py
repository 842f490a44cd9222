"""Step time: compute, exposed communication and pipeline bubble, from a stage's numbers.

Per micro-batch, a stage runs its forward (F FLOPs / t on each TP rank), a backward of 2F,
with checkpointing a second forward of the checkpointed layers, and the collectives that sit
on that path (tensor parallelism, the pipeline's messages, MoE all-to-alls, context
parallelism's blocks). The step is (PTD-P eq. 1)

    gas x t_mb  +  bubble x t_mb             (the slowest stage's t_mb; the bubble: p - 1
                                              for 1F1B, less for the zero-bubble schedules,
                                              bubble.py, with W the weight gradients' time)
    + (1 - overlap) x data-parallel traffic  (buckets reduced while backward runs)
    + the optimizer update                   (model-state bytes through memory; offloaded:
                                              through the host link and the host's optimizer)

Compute runs at the cluster's sustained TFLOP/s (cluster.tflops), plus a fixed cost per
layer and pass (``layer_overhead_us``, calibrated: what small shapes on a CPU spend outside
arithmetic); each collective costs its latency plus its ring bytes over the bandwidth of its
group (inside a node, or across nodes when the group spans them), and a blocking one the
calibrated wait of a call issued between kernels (``CALL_WAIT``, cluster.call_wait).

A pipeline whose ranks share cores (a CPU machine with fewer cores than ranks) is its
schedule run against one clock instead (``shared_pipeline``, contention.py): which stages
compute at the same moment decides how fast each does.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.plan.bubble import bubble_units, shares, split_share
from shardwise.plan.candidates import Layout
from shardwise.plan.cluster import Cluster
from shardwise.plan.contention import Run, StageCost, contended
from shardwise.plan.memory import ModelStates
from shardwise.plan.traffic import Call


@dataclass(frozen=True)
class StageWork:
    """One stage's work per micro-batch and per step (see the module docstring)."""

    flops: float  # forward FLOPs per micro-batch on this rank
    recompute_flops: float
    calls: list[Call]
    states: ModelStates
    layers: int = 0  # layers on this stage (each costs cluster.layer_cost_s() per pass)
    recompute_layers: int = 0  # checkpointed layers (their forward runs twice)
    ops: int = 0  # aten ops of the layers' forwards (traced): their fixed cost, if calibrated
    recompute_ops: int = 0  # of the checkpointed layers
    attention_calls: float = 0.0  # context-split attention calls (a recomputed one: 1/3)
    attention_flops: float = 0.0  # their forward FLOPs against the local keys (x cp: all)
    weight_flops: float = 0.0  # forward FLOPs of the weighted products (a weight gradient's)


@dataclass(frozen=True)
class StepTime:
    compute: float
    exposed_comm: float
    bubble: float

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble


ON_PATH = ("tensor", "pipeline", "expert", "context")  # waited for inside a micro-batch
CALL_WAIT = ("tensor", "expert", "data", "replicate", "hpz", "pipeline")


def spans_nodes(axis: str, layout: Layout, procs_per_node: int) -> bool:
    """Does a group of ``axis`` reach across nodes? (tp innermost, then cp, dp, pp; an
    expert group is ep consecutive data ranks; under MiCS "data" is the shard group and
    "replicate" spans the data ranks; hpZ's "hpz" is its secondary group.)"""
    tp, cp = layout.tp, layout.cp
    inner = {
        "tensor": tp,
        "context": tp * cp,
        "expert": tp * cp * layout.ep,
        "data": tp * layout.shard,
        "replicate": tp * cp * layout.dp,
        "hpz": tp * layout.hpz,
        "pipeline": layout.world,
    }[axis]
    return inner > procs_per_node


def by_link(calls: list[Call], layout: Layout, procs_per_node: int) -> dict[str, int]:
    """Bytes a rank sends per step over links inside its node and across nodes."""
    out = {"intra_node": 0, "inter_node": 0}
    for c in calls:
        out["inter_node" if spans_nodes(c.axis, layout, procs_per_node) else "intra_node"] += c.sent
    return out


def axis_time(calls: list[Call], layout: Layout, cluster: Cluster, axis: str) -> float:
    """Seconds of the calls of ``axis`` in one step."""
    total = 0.0
    for c in calls:
        if c.axis == axis and c.op != "recv":
            inter = spans_nodes(axis, layout, cluster.procs_per_node)
            total += c.count * cluster.collective_time(c.op, c.payload, c.n, inter)
            if axis in CALL_WAIT and c.op != "send":  # a message's wait: its hop (contention)
                total += c.count * cluster.call_wait(c.n)
    return total


def compute_time(work: StageWork, cluster: Cluster, precision: str, tp: int = 1) -> float:
    """One micro-batch's arithmetic: FLOPs / sustained rate (split by ``tp``: x the
    calibrated excess of a split layer's arithmetic), plus each layer's fixed cost
    (a recomputed forward is a third of a layer's forward + backward), which ranks
    sharing cores pay in turn: x procs_per_node / cores when there are fewer cores.
    Calibrated with the block's op count, a layer's fixed cost is the block's x its aten
    ops / the block's (an MoE block of 4 experts and its gate dispatches several times a
    dense block's ops); else one block's per layer."""
    rate = cluster.tflops(precision) * 1e12 / cluster.tp_compute_factor(tp)
    units = work.layers + work.recompute_layers / 3
    if cluster.layer_ops and work.ops:  # in calibration blocks' worth of aten ops
        units = (work.ops + work.recompute_ops / 3) / cluster.layer_ops
    fixed = units * cluster.layer_cost_s()
    return (3 * work.flops + work.recompute_flops) / rate + fixed * cluster.share()


def split_shares(
    work: StageWork, layout: Layout, cluster: Cluster, precision: str
) -> tuple[float, float]:
    """(F, W) as shares of a micro-batch's F + B: F its forward's FLOP share (bubble.shares),
    W what the weight gradients take of the micro-batch's time, their GEMMs (as many FLOPs
    as the weighted products' forward) at the stage's rate; the rest of the backward (the
    input gradients, the ops' fixed costs) is B's. On small shapes, where fixed costs rule,
    W is well under the third the FLOPs say, and a zero-bubble schedule has less to fill
    with."""
    f, w = shares(work.flops, work.recompute_flops)
    if not work.weight_flops:
        return f, w
    rate = cluster.tflops(precision) * 1e12 / cluster.tp_compute_factor(layout.tp)
    total = compute_time(work, cluster, precision, layout.tp)
    return f, min(w, round(work.weight_flops / rate / total, 3)) if total > 0 else w


def split_time(work: StageWork, layout: Layout, cluster: Cluster) -> float:
    """A micro-batch's share of what a split backward (B, then W: the zero-bubble schedules,
    split_linear.py) costs beyond the fused one: the calibrated ``split_overhead_us`` per
    layer (the calibration block has a GPT block's four linears; the cost goes with the
    linears routed and their deferred weight work, not with all of a layer's ops: scaled by
    ops, an MoE layer's 378 were charged 1.5-2x what its pipelines took) and, calibrated at
    two sizes, the layers' weighted-product FLOPs / ``split_flops_rate``; x the share of the
    schedule's backwards that split, x share (it is work, done in turns)."""
    fixed, rate = cluster.split_overhead_us * 1e-6, cluster.split_flops_rate
    if not (fixed or rate) or layout.pp == 1:
        return 0.0
    part = split_share(layout.schedule, layout.pp, layout.grad_accum)
    grows = work.weight_flops / rate if rate else 0.0
    return part * (work.layers * fixed + grows) * cluster.share()


def stage_compute(work: StageWork, layout: Layout, cluster: Cluster, precision: str) -> float:
    """One micro-batch's arithmetic and fixed costs (``compute_time``), its backward split."""
    return compute_time(work, cluster, precision, layout.tp) + split_time(work, layout, cluster)


def micro_batch_time(work: StageWork, layout: Layout, cluster: Cluster, precision: str) -> float:
    """The stage's forward + backward (+ recompute) and its on-path communication, once:
    tensor-parallel collectives, pipeline messages, MoE all-to-alls, context blocks."""
    compute = stage_compute(work, layout, cluster, precision)
    path = sum(axis_time(work.calls, layout, cluster, a) for a in ON_PATH)
    return compute + path / layout.grad_accum + context_excess(work, layout, cluster, precision)


def context_excess(work: StageWork, layout: Layout, cluster: Cluster, precision: str) -> float:
    """What context-parallel attention costs per micro-batch beyond its FLOPs and messages
    (calibrated, cluster.cp_call_time): c per call (waits on the neighbour, the ring's
    merges) and k x its arithmetic, 3 cp F / rate."""
    if layout.cp <= 1 or not work.attention_calls:
        return 0.0
    c, k = cluster.cp_call_time(layout.cp_method, layout.cp)
    arith = 3 * layout.cp * work.attention_flops / (cluster.tflops(precision) * 1e12)
    return work.attention_calls * c + k * arith


def optimizer_time(states: ModelStates, layout: Layout, cluster: Cluster) -> float:
    """Model-state bytes through memory, and the calibrated fixed cost of each parameter
    tensor the update steps (ranks sharing cores take turns: x share)."""
    on_device = states.params + states.grads + states.optimizer - states.host
    t = on_device / (cluster.optimizer_gbps * 1e9)
    if layout.offload:  # gradients down, parameters up, the update on the host
        t += (states.grads + states.params) / (cluster.host_gbps * 1e9)
        t += states.host / (cluster.host_optimizer_gbps * 1e9)
    t += states.tensors * cluster.optimizer_tensor_us * 1e-6
    return t * cluster.share()


def step_time(
    stages: list[StageWork], layout: Layout, cluster: Cluster, precision: str
) -> StepTime:
    """The step of the slowest stage (module docstring); a pipeline on ranks that share
    cores: the schedule run against a common clock (``shared_pipeline``). Plus the ranks'
    start skew (calibrated, ``Cluster.start_skew``): the step runs from its last rank's start
    (its first collective or message waits for it), its time is its first rank's."""
    skew = cluster.start_skew(layout.world)
    if layout.pp > 1 and cluster.share() > 1:
        t = shared_pipeline(stages, layout, cluster, precision)
        return StepTime(t.compute, t.exposed_comm + skew, t.bubble)
    per_mb = [micro_batch_time(w, layout, cluster, precision) for w in stages]
    slow = max(range(len(stages)), key=lambda i: per_mb[i])
    w = stages[slow]
    gas = layout.grad_accum
    compute = gas * stage_compute(w, layout, cluster, precision)
    on_path = per_mb[slow] * gas - compute
    exposed = on_path + (1.0 - cluster.overlap) * data_time(w, layout, cluster) + skew
    compute += optimizer_time(w.states, layout, cluster)
    f, wgt = split_shares(w, layout, cluster, precision)
    bubble = bubble_units(layout.schedule, layout.pp, gas, f, wgt) * per_mb[slow]
    return StepTime(compute, exposed, bubble)


def data_time(w: StageWork, layout: Layout, cluster: Cluster) -> float:
    """Seconds of the data-parallel calls of a step (reduction, ZeRO's gathers, hpZ's)."""
    return sum(axis_time(w.calls, layout, cluster, a) for a in ("data", "replicate", "hpz"))


def stage_cost(w: StageWork, layout: Layout, cluster: Cluster, precision: str) -> StageCost:
    """A stage's micro-batch on a core of its own (contention.py): its compute and context
    excess, which ``compute_time`` and ``cp_call_time`` charge x share, over share; its
    on-path calls of a micro-batch, waited for; a message to the next stage: its send and
    the wait of a call issued between kernels (``hop``). The calls of the step's end
    (``end_time``) come after the schedule."""
    work = stage_compute(w, layout, cluster, precision)
    work = (work + context_excess(w, layout, cluster, precision)) / cluster.share()
    during = [c for c in w.calls if not c.at_end]
    path = sum(axis_time(during, layout, cluster, a) for a in ON_PATH)
    sends = [c for c in during if c.axis == "pipeline" and c.op == "send"]
    hop = 0.0
    if sends:
        big = max(sends, key=lambda c: c.payload)
        inter = spans_nodes("pipeline", layout, cluster.procs_per_node)
        hop = cluster.collective_time("send", big.payload, 2, inter) + cluster.call_wait(2)
        path -= axis_time(sends, layout, cluster, "pipeline")
    f, wgt = split_shares(w, layout, cluster, precision)
    wait = max(path, 0.0) / layout.grad_accum
    return StageCost(f * work, (1.0 - f) * work, wgt * work, wait, hop)


def end_time(w: StageWork, layout: Layout, cluster: Cluster) -> float:
    """The on-path calls of a step's end (the loss, the gradient norm, tied weights)."""
    last = [c for c in w.calls if c.at_end]
    return sum(axis_time(last, layout, cluster, a) for a in ON_PATH)


def shared_run(
    stages: list[StageWork],
    layout: Layout,
    cluster: Cluster,
    precision: str,
    record: list | None = None,
) -> Run:
    """The schedule of ``layout`` run on its shared cores with each stage's costs
    (contention.py; ``record``: its instructions, for the timeline)."""
    costs = [stage_cost(w, layout, cluster, precision) for w in stages]
    ranks, cores, per_node = layout.world // layout.pp, cluster.cores, cluster.procs_per_node
    return contended(layout.schedule, layout.grad_accum, costs, ranks, cores, per_node, record)


def shared_pipeline(
    stages: list[StageWork], layout: Layout, cluster: Cluster, precision: str
) -> StepTime:
    """A pipeline's step when its ranks share cores: the schedule run in time with each
    stage's own costs (contention.py); the stage that ends last is the step's: its time
    computing, its waits, its idle time (the bubble), then the calls of the step's end,
    the data-parallel traffic and the update."""
    run = shared_run(stages, layout, cluster, precision)
    last = max(range(len(stages)), key=lambda i: run.finish[i])
    w = stages[last]
    exposed = run.waited[last] + end_time(w, layout, cluster)
    exposed += (1.0 - cluster.overlap) * data_time(w, layout, cluster)
    compute = run.busy[last] + optimizer_time(w.states, layout, cluster)
    bubble = max(run.makespan - run.busy[last] - run.waited[last], 0.0)
    return StepTime(compute, exposed, bubble)
