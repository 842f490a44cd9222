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
from shardwise.plan.idle import wait_quiet  # noqa: E402

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


MOE = dict(moe_experts=4, moe_k=1)  # --variants moe: each block's MLP a top-1 MoE of 4


def gpt_model(pipeline: bool, moe: bool = False, ep: int = 1) -> torch.nn.Module:
    """The example GPT (its MoE form with ``moe``: experts split over ``ep`` data ranks)."""
    import model as M

    torch.manual_seed(0)
    gpt = M.GPT(M.GPTConfig(**SHAPE, **(dict(MOE, ep=ep) if moe else {})))
    if not pipeline:
        return gpt
    from shardwise.pipe import PipelineModule

    pipe = PipelineModule(
        M.pipeline_layers(gpt), loss_fn=M.LMLoss(), aux_loss_fn=M.pipeline_aux_loss(gpt)
    )
    pipe.tp_plan = M.pipeline_tp_plan(SHAPE["n_layer"])
    return pipe


def config(layout: Layout) -> dict:
    import model as M

    cfg = to_config(layout, "fp32")
    if layout.pp > 1 and layout.tp > 1:  # the layers' names inside the PipelineModule
        cfg["tensor_parallel"]["plan"] = M.pipeline_tp_plan(SHAPE["n_layer"])
    return cfg


def train(rank: int, layout: Layout, warmup: int, steps: int, moe: bool) -> list[float]:
    """Runs on every rank (``spawn``): seconds of each timed ``train_batch``."""
    import torch.distributed as dist

    import shardwise

    net = gpt_model(layout.pp > 1, moe, layout.ep)
    engine, *_ = shardwise.initialize(model=net, config=config(layout))
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


def measure(
    layout: Layout, warmup: int, steps: int, quiet_s: float = 0.0, moe: bool = False
) -> float:
    from shardwise.spawn import spawn

    if quiet_s:
        wait_quiet(quiet_s)
    args = (layout, warmup, steps, moe)
    ranks = spawn(train, layout.world, args=args, backend="gloo", timeout=900)
    return statistics.median(max(step) for step in zip(*ranks, strict=True))


def name(lay: Layout) -> str:
    """The layout's name, its schedule always said for a pipeline (Layout.name omits 1F1B)."""
    extra = " 1f1b" if lay.pp > 1 and lay.schedule == "1f1b" else ""
    return lay.name() + extra


Case = tuple[str, Layout]  # (model form: "dense" or "moe", layout)
FAMILY = ("dp", "tp", "pp", "cp", "ep", "cp_method")  # and the schedule, or the ZeRO stage


def measure_all(cases: list[Case], args: argparse.Namespace) -> dict[Case, float]:
    """Each layout's seconds: the median of ``--rounds`` runs, the rounds interleaved (a burst
    of another job's work then lands on several layouts a little rather than on one a lot)."""
    times: dict[Case, list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for form, lay in cases:
            if (form, lay) in FAILED:
                continue
            try:
                t = measure(lay, args.warmup, args.steps, args.wait_quiet, form == "moe")
            except Exception as e:  # a layout the planner lists that does not run: say so
                FAILED[form, lay] = str(e).strip().splitlines()[-1][:300]
                print(f"  {form} {name(lay)} FAILED: {FAILED[form, lay]}", flush=True)
                continue
            times[form, lay].append(t)
    return {case: statistics.median(t) for case, t in times.items() if t}


FAILED: dict[Case, str] = {}  # layouts the planner lists that did not train, and why


def planners(data: dict, world: int, form: str) -> dict[int, Planner]:
    """The planner of each build of ``form`` on ``world`` ranks, by expert-parallel size: the
    dense GPT once; the MoE GPT once per ep (``MoE(ep_size=...)`` is a constructor argument).
    Both as PipelineModules, so pipelines are among the candidates."""
    machine_ = Cluster(**{**data, "procs_per_node": world})
    experts = MOE["moe_experts"]
    eps = [e for e in (1, 2, 4) if world % e == 0 and experts % e == 0] if form == "moe" else [1]
    out = {}
    for ep in eps:
        with torch.device("meta"):
            shape = read_model(gpt_model(True, form == "moe", ep), name=f"example GPT {form}")
        out[ep] = Planner(shape, machine_, GLOBAL_BATCH, SHAPE["block_size"], "fp32")
    return out


def feasible(forms: dict[int, Planner], world: int, cp: bool) -> list[dict]:
    """Every feasible record of every build, fastest predicted first (``cp``: context splits
    of the dense GPT too, which calls ``shardwise.attention``)."""
    recs = []
    for ep, planner in forms.items():
        sizes = (
            [c for c in (1, 2, 4) if world % c == 0]
            if cp and not planner.shape.expert_counts
            else None
        )
        lays = candidates(
            planner.shape, world, world, GLOBAL_BATCH, seq=SHAPE["block_size"], cp_sizes=sizes
        )
        recs += [r for r in planner.plan([x for x in lays if x.ep == ep]) if r["feasible"]]
    return sorted(recs, key=lambda r: r["step_time_s"])


def world_name(form: str, lay: Layout) -> str:
    return f"{lay.world} processes, {form}, {name(lay)}"


def as_layout(rec: dict) -> Layout:
    return Layout(**{k: rec[k] for k in Layout.__dataclass_fields__})


def sweep(recs: list[dict]) -> list[Layout]:
    """``--sweep``: the planner's best layout of each family (mesh, context method, and the
    schedule of a pipeline or else the ZeRO stage), each at the micro-batch and options it
    prefers: every kind of layout the library runs here, not a hand-picked few."""
    best: dict[tuple, dict] = {}
    for r in recs:
        kind = r["schedule"] if r["pp"] > 1 else r["zero_stage"]
        best.setdefault((*(r[k] for k in FAMILY), kind), r)
    return [as_layout(r) for r in best.values()]


def rows_for(forms: dict[int, Planner], form: str, measured: dict[Layout, float]) -> list[dict]:
    """Prediction against measurement, one row per measured layout."""
    rows = []
    for lay, seconds in measured.items():
        rec = forms[lay.ep].evaluate(lay)
        predicted = rec["step_time_s"]
        rows.append(dict(form=form, layout=lay, predicted=predicted, measured=seconds, rec=rec))
        err = abs(predicted - seconds) / seconds
        print(f"  {form:5s} {name(lay):36s} predicted {predicted:.3f} s measured {seconds:.3f} s "
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


def report(rows: list[dict], tops: dict[tuple[int, str], Layout]) -> str:
    table = []
    for r in rows:
        lay, form = r["layout"], r["form"]
        err = abs(r["predicted"] - r["measured"]) / r["measured"]
        mark = " (top)" if tops.get((lay.world, form)) == lay else ""
        t = r["rec"]["time"]
        split = f"{t['compute']:.3f}/{t['exposed_comm']:.3f}/{t['bubble']:.3f}"
        label = name(lay) + ("" if form == "dense" else f" {form}") + mark
        table.append([str(lay.world), label, f"{r['predicted']:.3f}", split,
                      f"{r['measured']:.3f}", f"{err:.0%}"])  # fmt: skip
    heads = ["procs", "layout", "predicted s", "cmp/comm/bubble", "measured s", "error"]
    lines = [format_table(heads, table)]
    errors = [abs(r["predicted"] - r["measured"]) / r["measured"] for r in rows]
    lines.append(f"\nmean error {statistics.mean(errors):.1%}, largest {max(errors):.1%}, "
                 f"{sum(e <= 0.15 for e in errors)} of {len(errors)} within 15%, "
                 f"{sum(e <= 0.25 for e in errors)} within 25%")  # fmt: skip
    for what, top, got, fastest in top_choices(rows, tops):
        if got is None:  # --measured: the changed model ranks a layout first that never ran
            lines.append(f"{what}: top choice {name(top)} was not measured")
            continue
        ok = "yes" if got <= 1.10 * fastest["measured"] else "NO"
        lines.append(f"{what}: top choice {name(top)} measured {got:.3f} s, fastest "
                     f"{name(fastest['layout'])} {fastest['measured']:.3f} s: within 10%: {ok}")  # fmt: skip
    return "\n".join(lines)


def top_choices(rows: list[dict], tops: dict) -> list[tuple[str, Layout, float | None, dict]]:
    """Per world and model form run: (what, the top choice, its measured seconds or None,
    the fastest measured row)."""
    out = []
    for (world, form), top in sorted(tops.items()):
        mine = [r for r in rows if r["layout"].world == world and r["form"] == form]
        if mine:
            got = next((r["measured"] for r in mine if r["layout"] == top), None)
            what = f"{world} processes, {form} ({len(mine)} layouts run)"
            out.append((what, top, got, min(mine, key=lambda r: r["measured"])))
    return out


def repredict(saved: dict, variants: set[str]) -> tuple[list[dict], dict]:
    """``--measured``: every stored run predicted again with the run's calibration, and each
    world's top choice among all its feasible layouts (rows, tops)."""
    rows, tops = [], {}
    for world in sorted({r["layout"].world for r in saved["runs"]}):
        for form in ("dense", "moe"):
            got = {r["layout"]: r["seconds"] for r in saved["runs"]
                   if r["layout"].world == world and r.get("form", "dense") == form}  # fmt: skip
            if got:
                forms = planners(saved["calibration"], world, form)
                tops[world, form] = as_layout(feasible(forms, world, "cp" in variants)[0])
                rows += rows_for(forms, form, got)
    return rows, tops


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
    p.add_argument("--sweep", action="store_true", help="also the best layout of every family")
    p.add_argument(
        "--variants",
        default="",
        help="moe (the MoE GPT: the best layout of each family), cp (context splits too)",
    )
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
        data = calibrate.measure([1, 2, 4], progress=print, quiet_s=0)  # waited above
        if args.save_calibration:
            calibrate.save(data, args.save_calibration)
    if saved is not None:
        m = saved["machine"]
        print(f"measured on {m['host']} ({m['cores']} cores) {m['date']}, "
              f"load average {m['load_average'][0]:.1f}", flush=True)  # fmt: skip
    worlds = [int(n) for n in args.procs.split(",")]
    variants = set(filter(None, args.variants.split(",")))
    rows, tops, runs = (
        repredict({**saved, "calibration": data}, variants) + ([],)
        if saved is not None
        else ([], {}, [])
    )
    for world, form in [(w, f) for w in worlds for f in ("dense", "moe")]:
        if saved is not None or (form == "moe" and "moe" not in variants):
            continue
        forms = planners(data, world, form)
        recs = feasible(forms, world, "cp" in variants)
        top = tops[world, form] = as_layout(recs[0])
        mine = [lay for lay in LAYOUTS if lay.world == world and form == "dense"]
        mine += [lay for lay in [top, *(sweep(recs) if args.sweep or form == "moe" else [])]
                 if lay not in mine]  # fmt: skip
        load = os.getloadavg()[0]
        print(f"{world} processes, {form}, {len(mine)} layouts (load {load:.1f}):", flush=True)
        got = {lay: t for (_, lay), t in measure_all([(form, x) for x in mine], args).items()}
        runs += [
            {"form": form, "layout": lay.as_dict(), "seconds": t,
             "load_average": [load, os.getloadavg()[0]]}
            for lay, t in got.items()
        ]  # fmt: skip
        rows += rows_for(forms, form, got)
    if args.save_measured and saved is None:
        save_measured(args.save_measured, data, runs, args)
    print()
    print(report(rows, tops))
    for (form, lay), why in FAILED.items():
        print(f"did not run: {world_name(form, lay)}: {why}")


if __name__ == "__main__":
    main()
