"""One layout's prediction: per-rank memory, traffic, step time; feasible or why not.

``Planner(model_shape, cluster, global_batch, seq, precision)`` evaluates layouts; its records
are plain dicts (the JSON of ``shardwise plan --json``), bytes per rank and seconds:

    dp, tp, pp, zero_stage, micro_batch, grad_accum, activation_checkpointing, offload,
    sequence_parallel, schedule, ep, cp, cp_method, feasible, reason,
    memory {params, grads, optimizer, activations, buffers, peak, host, checkpoint_staging,
    hpz_secondary}, mics, hpz, comm_bytes {data, tensor, pipeline, expert, context},
    link_bytes {intra_node, inter_node},
    comm_ops {op: {calls, bytes, sent_bytes}},
    bubble, step_time_s, time {compute, exposed_comm, bubble}, tokens_per_s, mfu, stage,
    estimate (the time rests on cluster numbers nobody measured: estimated, their names)

The numbers are the worst rank's: the stage with the highest device memory (memory and
feasibility), the slowest stage (time). ``rank_view`` gives any one rank's. ``host``: the
offloaded states; ``checkpoint_staging``: the host buffers of asynchronous checkpoints
(``Options.async_checkpoint``), named as ``engine.memory_breakdown()`` names them.

Schedules: the micro-batches a stage holds and the bubble are those of the library's own
instruction lists (bubble.py). ZBV and DualPipeV cut the layers into 2p virtual stages and
stage s runs virtual stages s and 2p-1-s (the V placement): its layers are two ranges, stage
0 holds the first and the last layers (and the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shardwise.parallel.pipeline.partition import PartitionError
from shardwise.parallel.pipeline.schedule import V_SCHEDULES, ScheduleError
from shardwise.plan import traffic
from shardwise.plan.activations import Trace, trace_layers
from shardwise.plan.bubble import held
from shardwise.plan.candidates import Layout
from shardwise.plan.cluster import Cluster, fmt_bytes
from shardwise.plan.memory import (
    ModelStates,
    Options,
    layout_params,
    model_states,
    range_params,
    range_tied,
    stage_bounds,
)
from shardwise.plan.shape import ModelShape
from shardwise.plan.timing import StageWork, by_link, step_time

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class StageView:
    """What one rank of stage ``stage`` holds and does."""

    stage: int
    layers: tuple[int, int]
    states: ModelStates
    activations: float  # saved-tensor bytes held at the peak
    loss_activations: float  # the part the loss saves (last stage; in ``activations``)
    transient: float  # a checkpointed layer's recompute, on top of that
    calls: list[traffic.Call]
    work: StageWork
    in_flight: int

    @property
    def peak(self) -> float:
        return self.states.device + self.activations + self.transient + self.states.buffers


@dataclass
class Planner:
    shape: ModelShape
    cluster: Cluster
    global_batch: int
    seq: int
    precision: str = "bf16"
    opts: Options = field(default_factory=Options)
    gradient_clipping: bool = True
    _traces: dict[tuple[int, int], Trace] = field(default_factory=dict)
    _bounds: dict[int, list[int]] = field(default_factory=dict)
    _states: dict[tuple, tuple] = field(default_factory=dict)

    def trace(self, micro_batch: int, cp: int = 1) -> Trace:
        """One micro-batch traced on the ``seq / cp`` tokens a context rank holds."""
        if (micro_batch, cp) not in self._traces:
            dtype = DTYPES[self.precision]
            tokens = self.seq // cp
            self._traces[micro_batch, cp] = trace_layers(self.shape, micro_batch, tokens, dtype)
        return self._traces[micro_batch, cp]

    def in_flight(self, layout: Layout, stage: int) -> float:
        """Micro-batches whose activations a stage holds at once (schedule.py); zero-bubble
        schedules: from a forward to its W (bubble.held), in whole-stage units."""
        if layout.pp == 1:
            return 1
        if layout.schedule == "gpipe":
            return layout.grad_accum
        if layout.schedule == "1f1b":
            return min(layout.pp - stage, layout.grad_accum)
        return held(layout.schedule, layout.pp, stage, layout.grad_accum)

    def ranges(self, layout: Layout, stage: int) -> list[tuple[int, int]]:
        """The layer ranges ``stage`` runs: its cut of ``pp``; in the V placement virtual
        stages ``stage`` and 2 pp - 1 - stage of a 2 pp cut; interleaved (two chunks in a
        loop) virtual stages ``stage`` and ``stage + pp``."""
        if layout.pp == 1 or layout.schedule not in (*V_SCHEDULES, "interleaved"):
            b = self.bounds(layout.pp)
            return [(b[stage], b[stage + 1])]
        b = self.bounds(2 * layout.pp)
        second = (
            stage + layout.pp if layout.schedule == "interleaved" else 2 * layout.pp - 1 - stage
        )
        return [(b[stage], b[stage + 1]), (b[second], b[second + 1])]

    def holds_loss(self, layout: Layout, stage: int) -> bool:
        """``stage`` runs the last layer (and the loss): p - 1, or 0 in a V."""
        return stage == (0 if layout.schedule in V_SCHEDULES else layout.pp - 1)

    def bounds(self, pp: int) -> list[int]:
        """The stages' layer boundaries (PipelineModule's partition; computed once per pp)."""
        if pp not in self._bounds:
            self._bounds[pp] = stage_bounds(self.shape, pp, self.opts.partition_method)
        return self._bounds[pp]

    def _stage_states(self, layout: Layout, stage: int) -> tuple:
        """(params, isolated, model states, data-parallel calls), cached: they do not depend
        on the micro-batch or on checkpointing."""
        key = (layout.tp, layout.pp, layout.dp, layout.zero_stage, layout.offload, stage)
        key += (layout.mics, layout.hpz, layout.grad_accum, layout.schedule, layout.ep, layout.cp)
        if key not in self._states:
            ranges = self.ranges(layout, stage)
            params = layout_params(range_params(self.shape, ranges), layout, self.shape.free_ep)
            isolate = range_tied(self.shape, ranges) if layout.pp > 1 else set()
            states = model_states(params, layout, self.precision, self.opts, isolate)
            data = traffic.data_calls(params, layout, self.precision, self.opts, isolate)
            self._states[key] = (params, isolate, states, data)
        return self._states[key]

    def model_states(self, layout: Layout, stage: int) -> ModelStates:
        """A rank's model states on ``stage`` (no trace needed)."""
        return self._stage_states(layout, stage)[2]

    def stage_view(self, layout: Layout, stage: int) -> StageView:
        ranges = self.ranges(layout, stage)
        lo, hi = ranges[0]
        params, isolate, states, data = self._stage_states(layout, stage)
        tr = self.trace(layout.micro_batch, layout.cp)
        acts = [a for a0, a1 in ranges for a in tr.layers[a0:a1]]
        tp, sp = layout.tp, layout.sequence_parallel
        kept = [a.checkpointed if layout.activation_checkpointing else a.plain for a in acts]
        per_mb = sum(k.per_rank(tp, sp) for k in kept)
        loss = tr.loss.per_rank(tp, sp) if self.holds_loss(layout, stage) else 0.0
        k = self.in_flight(layout, stage)
        transient = 0.0
        recompute = 0.0
        if layout.activation_checkpointing:
            transient = max((a.plain.per_rank(tp, sp) for a in acts), default=0.0)
            recompute = sum(a.flops for a in acts if a.checkpointed != a.plain) / tp
        calls = data + self._calls(layout, stage, params, acts, ranges)
        again = (
            sum(a.checkpointed != a.plain for a in acts) if layout.activation_checkpointing else 0
        )
        # Context parallelism: a rank's queries meet all cp blocks of keys (x cp in attention).
        flops = sum(a.flops + (layout.cp - 1) * a.attention_flops for a in acts) / tp
        ops = sum(a.ops for a in acts)
        redo = sum(a.ops for a in acts if a.checkpointed != a.plain)
        redo = redo if layout.activation_checkpointing else 0
        attn = _attention(acts, layout) if layout.cp > 1 else (0.0, 0.0)
        weight = sum(a.flops - a.attention_flops for a in acts) / tp
        work = StageWork(
            flops, recompute, calls, states, len(acts), again, ops, redo, *attn, weight
        )
        acts_held, loss_held = k * (per_mb + loss), k * loss
        return StageView(stage, (lo, hi), states, acts_held, loss_held, transient, calls, work, k)

    def _calls(
        self, layout: Layout, stage: int, params: list, acts: list, ranges: list
    ) -> list[traffic.Call]:
        """Tensor, pipeline and scalar calls of one step (the data calls are cached)."""
        tr = self.trace(layout.micro_batch, layout.cp)
        calls = []
        sites = [s for a in acts for s in a.tp_sites]
        calls += traffic.expert_calls(sites, layout, False)
        calls += traffic.context_calls(sites, layout, self.precision, False)
        if self.holds_loss(layout, stage):
            sites += list(tr.loss_sites)
        sp_params = [p for p in params if p.sequence_parallel]
        calls += traffic.tensor_calls(sites, sp_params, layout, self.precision, stage == 0)
        if layout.activation_checkpointing:
            again = [s for a in acts for s in a.recompute_sites]
            calls += traffic.tensor_calls(again, [], layout, self.precision, False, True)
            calls += traffic.expert_calls(again, layout, True)
            redone = [s for a in acts if a.checkpointed != a.plain for s in a.tp_sites]
            calls += traffic.context_calls(redone, layout, self.precision, True)
        c = 2 if self.precision != "fp32" else 4
        # A V's chunk 1 is a pipeline run backwards over the stages: stage s plays p-1-s.
        loop = layout.schedule == "interleaved"  # chunk k: first of all / last of all
        ends = [(stage == 0, False), (False, stage == layout.pp - 1)] if loop else [None, None]
        for (lo, hi), as_stage, end in zip(
            ranges, (stage, layout.pp - 1 - stage), ends, strict=False
        ):
            bytes_in = tr.layers[lo - 1].output_bytes if lo > 0 else 0
            out = tr.layers[hi - 1]
            calls += traffic.pipeline_calls(
                layout, as_stage, bytes_in, out.output_bytes, out.output_ndim, c, end
            )
        calls += self._tied_calls(layout, stage, params)
        norm = self.gradient_clipping or self.precision == "fp16"
        apart = any(p.is_expert and p.ep > 1 for p in params)
        calls += traffic.scalar_calls(layout, stage, self.precision, norm, apart)
        return calls

    def _tied_calls(self, layout: Layout, stage: int, params: list) -> list[traffic.Call]:
        """Each TiedLayerSpec key's gradient sum over the stages holding it; its parameters
        lead ``params`` (range_params), keys in the order the stage's layers use them."""
        if layout.pp == 1:
            return []
        held: dict[str, set[int]] = {}
        for s in range(layout.pp):
            for lo, hi in self.ranges(layout, s):
                for x in self.shape.layers[lo:hi]:
                    if x.tied:
                        held.setdefault(x.tied, set()).add(s)
        mine = [x.tied for lo, hi in self.ranges(layout, stage) for x in self.shape.layers[lo:hi]]
        calls, start = [], 0
        for key in dict.fromkeys(k for k in mine if k):
            n = len(self.shape.tied[key])
            ps = [p for p in params[start : start + n] if p.trainable]
            calls += traffic.tied_calls(ps, len(held[key]), layout, self.precision, self.opts)
            start += n
        return calls

    def evaluate(self, layout: Layout) -> dict[str, Any]:
        try:
            views = [self.stage_view(layout, s) for s in range(layout.pp)]
        except PartitionError as e:
            return _record(layout, None, None, reason=f"pipeline partition: {e}".split("\n")[0])
        except ScheduleError as e:
            return _record(layout, None, None, reason=str(e))
        worst = max(views, key=lambda v: v.peak)
        time = step_time([v.work for v in views], layout, self.cluster, self.precision)
        rec = _record(layout, worst, time)
        rec["link_bytes"] = by_link(worst.calls, layout, self.cluster.procs_per_node)
        tokens = layout.global_batch * self.seq
        rec["tokens_per_s"] = tokens / time.total if time.total > 0 else 0.0
        layers = self.trace(layout.micro_batch, layout.cp).layers
        flops = 3 * sum(a.flops + (layout.cp - 1) * a.attention_flops for a in layers)
        rate = self.cluster.peak_tflops if self.precision != "fp32" else self.cluster.fp32_tflops
        useful = flops * layout.grad_accum * layout.dp * layout.cp
        rec["mfu"] = useful / (time.total * layout.world * rate * 1e12) if time.total else 0.0
        comm = any(c.count for c in worst.calls if c.op != "recv")
        data = any(c.axis == "data" for c in worst.calls)
        rec["estimated"] = self.cluster.estimated_for(layout.offload, comm, data)
        rec["estimate"] = bool(rec["estimated"])
        if worst.peak > self.cluster.device_memory:
            rec["feasible"] = False
            rec["reason"] = (
                f"needs {fmt_bytes(worst.peak)} per rank, has {fmt_bytes(self.cluster.device_memory)}"
            )
        return rec

    def plan(self, layouts: list[Layout]) -> list[dict[str, Any]]:
        """Records of ``layouts``: feasible ones by predicted step time, then the others."""
        recs = [self.evaluate(lay) for lay in layouts]
        return sorted(recs, key=lambda r: (not r["feasible"], r["step_time_s"] or 0.0))


def _record(layout: Layout, view: StageView | None, time: Any, reason: str = "") -> dict:
    rec: dict[str, Any] = layout.as_dict()
    rec["feasible"], rec["reason"] = view is not None, reason
    if view is None:
        rec.update(memory=None, comm_bytes=None, step_time_s=None, tokens_per_s=0.0, mfu=0.0)
        return rec
    s = view.states
    rec["memory"] = {
        "params": s.params,
        "grads": s.grads,
        "optimizer": s.optimizer,
        "activations": int(view.activations),
        "buffers": int(s.buffers + view.transient),
        "peak": int(view.peak),
        "host": s.host,
        "checkpoint_staging": s.checkpoint_staging,
        "hpz_secondary": s.secondary,
    }
    rec["comm_bytes"] = traffic.by_axis(view.calls)
    rec["comm_ops"] = traffic.by_op(view.calls)
    rec["stage"] = view.stage
    rec["bubble"] = time.bubble / time.total if time.total else 0.0
    rec["step_time_s"] = time.total
    rec["time"] = {
        "compute": time.compute,
        "exposed_comm": time.exposed_comm,
        "bubble": time.bubble,
    }
    return rec


def _attention(acts: list, layout: Layout) -> tuple[float, float]:
    """(calls, forward FLOPs) of the stage's context-split attention per micro-batch: each
    traced ``attn`` site is a call (recomputed under checkpointing: a forward, 1/3 of one)."""
    calls = sum(1 for a in acts for site, _ in a.tp_sites if site == "attn")
    if layout.activation_checkpointing:
        calls += sum(a.checkpointed != a.plain for a in acts) / 3
    return float(calls), sum(a.attention_flops for a in acts) / layout.tp
