"""``shardwise plan --plot`` and ``--timeline``: the records drawn, not recomputed.

Each picture is two functions: one returns the numbers to draw (tested), a thin one draws
them with matplotlib (imported there: the planner runs without it).

    plot_data(records, limit)    per layout: memory per rank by kind (GiB) against the device
                                 limit; step time split into compute, exposed communication
                                 and bubble (seconds), as the records hold them
    timeline_data(planner, lay)  per pipeline stage (its dp x cp x tp ranks do the same):
                                 segments (kind, start, end, micro-batch) over one step

The timeline is the step-time model laid out in time: the library's simulator runs the
schedule's instruction lists (parallel/pipeline/simulate.py) with a micro-batch's forward,
backward and weight shares (timing.split_shares) in units of the slowest stage's micro-batch time
t_mb, as timing.step_time charges it; each compute segment ends with its share of the
on-path communication (tensor, pipeline, expert, context: t_mb - compute per micro-batch),
and the step ends with the exposed data-parallel traffic and the optimizer update. The
slowest stage (``slow``) ends at the record's ``step_time_s``; the gaps are the bubble (a stage
with a larger update, the embedding's, may end a little later: the model charges the slowest's).
With ranks sharing cores, the timeline is the run timing.shared_pipeline times
(contention.py): each instruction's work at the speed the busy stages leave it, then its wait;
the stage that ends last ends at the record's ``step_time_s``.
"""

from __future__ import annotations

from typing import Any

from shardwise.parallel.pipeline.instructions import Op
from shardwise.parallel.pipeline.schedule import placement_of
from shardwise.parallel.pipeline.simulate import timeline
from shardwise.plan.bubble import chunks_of, run_order
from shardwise.plan.candidates import Layout
from shardwise.plan.cluster import GIB
from shardwise.plan.evaluate import Planner
from shardwise.plan.timing import (
    axis_time,
    compute_time,
    data_time,
    end_time,
    micro_batch_time,
    optimizer_time,
    shared_run,
    split_shares,
)

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "buffers")
TIME_KINDS = ("compute", "exposed_comm", "bubble")
PASS = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.BACKWARD_INPUT: "backward"}
PASS[Op.BACKWARD_WEIGHT] = "weight"
COLOURS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "weight": "#8fd19e",
    "comm": "#dd8452",
    "data comm": "#c44e52",
    "optimizer": "#8172b3",
}


def _name(r: dict) -> str:
    return Layout(**{k: r[k] for k in Layout.__dataclass_fields__}).name()


def plot_data(records: list[dict], limit: int, top: int = 6) -> dict[str, Any]:
    """The ``top`` feasible records' numbers (module docstring), in GiB and seconds."""
    best = [r for r in records if r["feasible"]][:top]
    return {
        "names": [_name(r) for r in best],
        "limit_gib": limit / GIB,
        "memory_gib": {k: [r["memory"][k] / GIB for r in best] for k in MEMORY_KINDS},
        "time_s": {k: [r["time"][k] for r in best] for k in TIME_KINDS},
    }


def draw_plot(data: dict[str, Any], path: str) -> None:
    """Memory stacked by kind against the limit (left), step time split (right), to ``path``."""
    plt = _pyplot()
    fig, (mem, tim) = plt.subplots(1, 2, figsize=(12, 1.5 + 0.6 * len(data["names"])))
    for ax, parts, unit in ((mem, data["memory_gib"], "GiB per rank"), (tim, data["time_s"], "s")):
        left = [0.0] * len(data["names"])
        for kind, values in parts.items():
            ax.barh(data["names"], values, left=left, label=kind)
            left = [a + b for a, b in zip(left, values, strict=True)]
        ax.set_xlabel(unit)
        ax.invert_yaxis()
        ax.legend(fontsize="small")
    mem.axvline(data["limit_gib"], color="black", linestyle="--", label="device limit")
    mem.set_title("memory per rank (worst stage)")
    tim.set_title("predicted step time")
    tim.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timeline_data(planner: Planner, layout: Layout) -> dict[str, Any]:
    """One step of ``layout``, per stage: segments and the total (module docstring)."""
    views = [planner.stage_view(layout, s) for s in range(layout.pp)]
    cluster, precision = planner.cluster, planner.precision
    if layout.pp > 1 and cluster.share() > 1:
        return _shared_timeline(planner, layout, views)
    per_mb = [micro_batch_time(v.work, layout, cluster, precision) for v in views]
    slow = max(range(layout.pp), key=lambda i: per_mb[i])
    t_mb = per_mb[slow]
    f, w = split_shares(views[slow].work, layout, cluster, precision)
    chunks, gas = chunks_of(layout.schedule), layout.grad_accum
    progs = [run_order(layout.schedule, layout.pp, s, gas, chunks) for s in range(layout.pp)]
    done: list = []
    finish, _ = timeline(progs, chunks, f, 1.0 - f, w, placement_of(layout.schedule), done)
    end = max(finish) * t_mb
    rows = []
    for s, view in enumerate(views):
        comm_share = 1.0 - compute_time(view.work, cluster, precision, layout.tp) / per_mb[s]
        segs = []
        for stage, a, b, ins in done:
            if stage == s:
                a, b = a * t_mb, b * t_mb
                cut = b - (b - a) * comm_share
                segs.append((PASS.get(ins.op, "forward"), a, cut, ins.mb))
                segs.append(("comm", cut, b, ins.mb))
        data = (1.0 - cluster.overlap) * axis_time(view.calls, layout, cluster, "data")
        opt = optimizer_time(view.states, layout, cluster)
        segs += [
            ("data comm", end, end + data, -1),
            ("optimizer", end + data, end + data + opt, -1),
        ]
        rows.append({"stage": s, "segments": [x for x in segs if x[2] > x[1]]})
    total = max(seg[2] for row in rows for seg in row["segments"])
    return {
        "name": layout.name(),
        "rows": rows,
        "total_s": total,
        "micro_batch_s": t_mb,
        "slow": slow,
    }


def _shared_timeline(planner: Planner, layout: Layout, views: list) -> dict[str, Any]:
    """The timeline of ranks that share cores: contention.py's run of the schedule (each
    instruction's work, then its wait), then the step's end calls, data traffic, update."""
    cluster, precision = planner.cluster, planner.precision
    done: list = []
    run = shared_run([v.work for v in views], layout, cluster, precision, done)
    end, rows = run.makespan, []
    for s, view in enumerate(views):
        segs = []
        for stage, a, cut, b, ins in done:
            if stage == s:
                segs += [(PASS.get(ins.op, "forward"), a, cut, ins.mb), ("comm", cut, b, ins.mb)]
        calls = end + end_time(view.work, layout, cluster)
        data = calls + (1.0 - cluster.overlap) * data_time(view.work, layout, cluster)
        opt = data + optimizer_time(view.states, layout, cluster)
        segs += [("comm", end, calls, -1), ("data comm", calls, data, -1)]
        segs += [("optimizer", data, opt, -1)]
        rows.append({"stage": s, "segments": [x for x in segs if x[2] > x[1]]})
    last = max(range(layout.pp), key=lambda i: run.finish[i])
    total = max(seg[2] for row in rows for seg in row["segments"])
    return {"name": layout.name(), "rows": rows, "total_s": total, "slow": last}


def draw_timeline(data: dict[str, Any], path: str) -> None:
    """Each stage a row of coloured segments over the step (white: idle), to ``path``."""
    plt = _pyplot()
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.5 * len(rows)))
    for row in rows:
        for kind, a, b, mb in row["segments"]:
            ax.barh(row["stage"], b - a, left=a, color=COLOURS[kind], edgecolor="white", lw=0.3)
            if mb >= 0 and kind != "comm" and b - a > data["total_s"] / 60:
                ax.text((a + b) / 2, row["stage"], str(mb), ha="center", va="center", fontsize=6)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(
        handles,
        list(COLOURS),
        fontsize="small",
        loc="lower center",
        ncol=6,
        bbox_to_anchor=(0.5, 1.08),
        frameon=False,
    )  # above the rows, never over them
    ax.set_yticks([r["stage"] for r in rows], [f"stage {r['stage']}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (numbers: micro-batch; white: idle)")
    ax.set_title(f"one step of {data['name']}: {data['total_s']:.3g} s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pyplot() -> Any:
    try:
        import matplotlib  # noqa: PLC0415 - optional: only the pictures need it
    except ImportError:
        raise ValueError("--plot / --timeline need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt
