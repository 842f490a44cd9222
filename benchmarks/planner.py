"""The planner's step time against the clock: calibrate, predict, run each layout, compare.

    python benchmarks/planner.py                       # calibrates first (about a minute)
    python benchmarks/planner.py --calibration calib.json --steps 6
    python benchmarks/planner.py --save-measured runs.json     # keep the measured seconds
    python benchmarks/planner.py --measured runs.json          # predict again, run nothing

1. ``shardwise plan --calibrate``'s measurement (1, 2 and 4 processes), unless a preset is
   given; the planner then predicts every layout with it.
2. Each layout of ``LAYOUTS`` (and the planner's own top choice per world, if not among
   them) trains the example GPT (examples/gpt/model.py) for ``--warmup`` + ``--steps``
   ``train_batch`` steps on 2 or 4 gloo processes started by ``shardwise.spawn``, one thread
   each; a step's time is the slowest rank's, a run's the median of its timed steps, the
   layout's the median of ``--rounds`` runs (interleaved with the other layouts').
   ``--save-measured FILE`` keeps each layout's seconds with the machine, its load average
   and the calibration; ``--measured FILE`` skips 1 and 2 and predicts those layouts again
   (after a change to the time model: the table re-taken from a quiet machine's runs).
3. A table: predicted and measured seconds, the error |p - m| / m per layout, the mean
   error, and whether the planner's top choice per world is within 10% of the fastest
   measured layout of that world.

fp32 (CPU), the config ``shardwise.plan.to_config`` writes, random tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # common.py
sys.path.insert(0, str(HERE.parent / "examples" / "gpt"))  # the example's model.py

import torch  # noqa: E402
from common import format_table  # noqa: E402

from shardwise.plan import Cluster, Layout, Planner, calibrate, candidates, read_model  # noqa: E402
from shardwise.plan.candidates import to_config  # noqa: E402

SHAPE = dict(vocab_size=96, block_size=128, n_layer=4, n_head=4, n_embd=128)
GLOBAL_BATCH = 8  # sequences per step
L = Layout
LAYOUTS = [  # dp, tp, pp, zero, micro-batch, accumulation, checkpointing, offload, sp, schedule
    L(2, 1, 1, 0, 4, 1),
    L(2, 1, 1, 1, 4, 1),
    L(2, 1, 1, 2, 2, 2),
    L(2, 1, 1, 3, 4, 1),
    L(2, 1, 1, 0, 4, 1, True),
    L(1, 2, 1, 0, 8, 1),
    L(1, 1, 2, 0, 2, 4, schedule="gpipe"),
    L(1, 1, 2, 0, 2, 4, schedule="1f1b"),
    L(4, 1, 1, 0, 2, 1),
    L(4, 1, 1, 3, 2, 1),
    L(2, 2, 1, 1, 4, 1),
    L(2, 1, 2, 0, 2, 2),
    L(1, 2, 2, 0, 2, 4),
    L(2, 2, 1, 0, 4, 1, True),
]


def gpt_model(pipeline: bool) -> torch.nn.Module:
    import model as M

    torch.manual_seed(0)
    gpt = M.GPT(M.GPTConfig(**SHAPE))
    if not pipeline:
        return gpt
    from shardwise.pipe import PipelineModule

    pipe = PipelineModule(M.pipeline_layers(gpt), loss_fn=M.LMLoss())
    pipe.tp_plan = M.pipeline_tp_plan(SHAPE["n_layer"])
    return pipe


def config(layout: Layout) -> dict:
    import model as M

    cfg = to_config(layout, "fp32")
    if layout.pp > 1 and layout.tp > 1:  # the layers' names inside the PipelineModule
        cfg["tensor_parallel"]["plan"] = M.pipeline_tp_plan(SHAPE["n_layer"])
    return cfg


def train(rank: int, layout: Layout, warmup: int, steps: int) -> list[float]:
    """Runs on every rank (``spawn``): seconds of each timed ``train_batch``."""
    import torch.distributed as dist

    import shardwise

    engine, *_ = shardwise.initialize(model=gpt_model(layout.pp > 1), config=config(layout))
    g = torch.Generator().manual_seed(engine.dp_rank)
    V, T = SHAPE["vocab_size"], SHAPE["block_size"]
    x = torch.randint(0, V, (layout.micro_batch, T), generator=g)
    batches = [(x, torch.roll(x, -1, 1))] * layout.grad_accum
    times = []
    for _ in range(warmup + steps):
        dist.barrier()  # every rank starts the step together: the slowest one sets its time
        start = time.perf_counter()
        engine.train_batch(iter(batches))
        times.append(time.perf_counter() - start)
    return times[warmup:]


def busy_share(seconds: float = 2.0) -> float:
    """The machine's busy share of CPU time over ``seconds`` (/proc/stat; 0 where absent)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait

    if not os.path.exists("/proc/stat"):
        return 0.0
    (t0, i0), _ = sample(), time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(limit_s: float) -> float:
    """Wait (up to ``limit_s``) until other jobs leave the cores idle: a step timed while the
    machine is shared measures the other jobs. Returns the last busy share seen."""
    deadline = time.monotonic() + limit_s
    busy = busy_share()
    while busy > 0.15 and time.monotonic() < deadline:
        busy = busy_share()
    return busy


def measure(layout: Layout, warmup: int, steps: int, quiet_s: float = 0.0) -> float:
    from shardwise.spawn import spawn

    if quiet_s:
        wait_quiet(quiet_s)
    ranks = spawn(train, layout.world, args=(layout, warmup, steps), backend="gloo", timeout=900)
    return statistics.median(max(step) for step in zip(*ranks, strict=True))


def name(lay: Layout) -> str:
    """The layout's name, its schedule always said for a pipeline (Layout.name omits 1F1B)."""
    extra = " 1f1b" if lay.pp > 1 and lay.schedule == "1f1b" else ""
    return lay.name() + extra


def measure_all(layouts: list[Layout], args: argparse.Namespace) -> dict[Layout, float]:
    """Each layout's seconds: the median of ``--rounds`` runs, the rounds interleaved (a burst
    of another job's work then lands on several layouts a little rather than on one a lot)."""
    times: dict[Layout, list[float]] = {lay: [] for lay in layouts}
    for _ in range(args.rounds):
        for lay in layouts:
            times[lay].append(measure(lay, args.warmup, args.steps, args.wait_quiet))
    return {lay: statistics.median(t) for lay, t in times.items()}


def rows_for(planner: Planner, measured: dict[Layout, float]) -> list[dict]:
    """Prediction against measurement, one row per measured layout."""
    rows = []
    for lay, seconds in measured.items():
        rec = planner.evaluate(lay)
        predicted = rec["step_time_s"]
        rows.append(dict(layout=lay, predicted=predicted, measured=seconds, rec=rec))
        err = abs(predicted - seconds) / seconds
        print(f"  {name(lay):36s} predicted {predicted:.3f} s measured {seconds:.3f} s "
              f"error {err:.0%}", flush=True)  # fmt: skip
    return rows


def machine() -> dict:
    """What the measurement was taken on, and how busy the machine was."""
    import platform

    return {
        "host": platform.node(),
        "cores": calibrate.cores(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_average": list(os.getloadavg()),
    }


def save_measured(path: str, data: dict, runs: list[dict], args: argparse.Namespace) -> None:
    """``--save-measured``: the calibration, the machine (load average at the end) and each
    layout's seconds with the load average when its world started and ended (JSON)."""
    out = {
        "machine": machine(),
        "settings": {"warmup": args.warmup, "steps": args.steps, "rounds": args.rounds},
        "calibration": data,
        "runs": runs,
    }
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"saved the measurements to {path}", flush=True)


def load_measured(path: str) -> dict:
    """``--measured``: a file ``--save-measured`` wrote; ValueError naming the flag if not."""
    try:
        saved = json.loads(Path(path).read_text())
        for run in saved["runs"]:
            run["layout"] = Layout(**run["layout"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--measured {path!r}: not a file --save-measured wrote ({e})") from None
    return saved


def top_choice(planner: Planner, world: int) -> Layout:
    """The planner's best feasible layout of ``world`` ranks (its first record)."""
    shape = planner.shape
    lays = list(candidates(shape, world, world, GLOBAL_BATCH))
    best = next(r for r in planner.plan(lays) if r["feasible"])
    return Layout(**{k: best[k] for k in Layout.__dataclass_fields__})


def report(rows: list[dict], tops: dict[int, Layout]) -> str:
    table = []
    for r in rows:
        lay = r["layout"]
        err = abs(r["predicted"] - r["measured"]) / r["measured"]
        mark = " (top)" if tops.get(lay.world) == lay else ""
        t = r["rec"]["time"]
        split = f"{t['compute']:.3f}/{t['exposed_comm']:.3f}/{t['bubble']:.3f}"
        table.append([str(lay.world), name(lay) + mark, f"{r['predicted']:.3f}", split,
                      f"{r['measured']:.3f}", f"{err:.0%}"])  # fmt: skip
    heads = ["procs", "layout", "predicted s", "cmp/comm/bubble", "measured s", "error"]
    lines = [format_table(heads, table)]
    errors = [abs(r["predicted"] - r["measured"]) / r["measured"] for r in rows]
    lines.append(f"\nmean error {statistics.mean(errors):.1%}, largest {max(errors):.1%}, "
                 f"{sum(e <= 0.25 for e in errors)} of {len(errors)} within 25%")  # fmt: skip
    for world, top in sorted(tops.items()):
        mine = [r for r in rows if r["layout"].world == world]
        fastest = min(r["measured"] for r in mine)
        got = next((r["measured"] for r in mine if r["layout"] == top), None)
        if got is None:  # --measured: the changed model ranks a layout first that never ran
            lines.append(f"{world} processes: top choice {name(top)} was not measured")
            continue
        ok = "yes" if got <= 1.10 * fastest else "NO"
        lines.append(f"{world} processes: top choice {name(top)} measured {got:.3f} s, "
                     f"fastest {fastest:.3f} s: within 10%: {ok}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calibration", help="a preset JSON from `shardwise plan --calibrate`")
    p.add_argument("--save-calibration", help="where to keep this run's calibration")
    p.add_argument("--save-measured", help="where to keep each layout's measured seconds")
    p.add_argument("--measured", help="a --save-measured file: predict its layouts, run none")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--procs", default="2,4", help="worlds to run")
    p.add_argument("--rounds", type=int, default=2, help="measurements per layout (median)")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=120.0,
        help="seconds to wait for idle cores before each measurement (0: never)",
    )
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    saved = load_measured(args.measured) if args.measured else None
    if args.calibration:
        data = json.loads(Path(args.calibration).read_text())
    elif saved is not None:
        data = saved["calibration"]
    else:
        print(f"waiting for idle cores: busy {wait_quiet(args.wait_quiet):.0%}", flush=True)
        data = calibrate.measure([1, 2, 4], progress=print)
        if args.save_calibration:
            calibrate.save(data, args.save_calibration)
    if saved is not None:
        m = saved["machine"]
        print(f"measured on {m['host']} ({m['cores']} cores) {m['date']}, "
              f"load average {m['load_average'][0]:.1f}", flush=True)  # fmt: skip
    worlds = [int(n) for n in args.procs.split(",")]
    with torch.device("meta"):
        shape = read_model(gpt_model(pipeline=True), name="example GPT")
    rows, tops, runs = [], {}, []
    for world in worlds:
        machine_ = Cluster(**{**data, "procs_per_node": world})
        planner = Planner(shape, machine_, GLOBAL_BATCH, SHAPE["block_size"], "fp32")
        tops[world] = top_choice(planner, world)
        if saved is not None:
            got = {r["layout"]: r["seconds"] for r in saved["runs"] if r["layout"].world == world}
        else:
            mine = [lay for lay in LAYOUTS if lay.world == world]
            mine += [tops[world]] if tops[world] not in mine else []
            load = os.getloadavg()[0]
            print(f"{world} processes (load average {load:.1f}):", flush=True)
            got = measure_all(mine, args)
            runs += [
                {"layout": lay.as_dict(), "seconds": t, "load_average": [load, os.getloadavg()[0]]}
                for lay, t in got.items()
            ]
        rows += rows_for(planner, got)
    if args.save_measured and saved is None:
        save_measured(args.save_measured, data, runs, args)
    print()
    print(report(rows, tops))


if __name__ == "__main__":
    main()
