"""``shardwise plan``: every layout of a model on a cluster, ranked by predicted step time.

    shardwise plan --arch llama --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 \\
        --vocab 128256 --seq 4096 --nodes 128 --procs-per-node 8 --cluster a100-80g \\
        --global-batch 1024 --top 10
    shardwise plan --model mypkg.models:build --seq 1024 --procs-per-node 2 \\
        --cluster this-machine --global-batch 16 --json
    shardwise plan ... --write-config ds_config.json      # the best layout's config
    shardwise plan --calibrate                             # measure this machine
    shardwise plan ... --simulate 517 --dp 16 --tp 8 --pp 8 --zero-stage 1
    shardwise plan ... --plot top.png --timeline step.png  # pictures of the records
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from shardwise.plan import calibrate, pictures, simulate
from shardwise.plan.candidates import PRECISIONS, Layout, candidates, to_config
from shardwise.plan.cluster import PRESETS, Cluster, load, parse_bytes, with_overrides
from shardwise.plan.evaluate import Planner
from shardwise.plan.memory import Options
from shardwise.plan.models import Dims, build
from shardwise.plan.report import rank_text, table
from shardwise.plan.shape import ModelShape, read_model

MODEL_FLAGS = [
    ("--arch", dict(default="gpt", choices=["gpt", "llama"], help="the decoder's kind")),
    ("--layers", dict(type=int, help="transformer blocks")),
    ("--hidden", dict(type=int, help="hidden size")),
    ("--heads", dict(type=int, help="attention heads")),
    ("--kv-heads", dict(type=int, help="key/value heads (grouped-query attention)")),
    ("--ffn", dict(type=int, help="MLP width (default 4 x hidden, Llama: about 8/3)")),
    ("--vocab", dict(type=int, help="vocabulary size")),
    ("--seq", dict(type=int, help="sequence length (tokens per sequence)")),
    ("--moe-experts", dict(type=int, default=0, help="experts per MoE block (0: dense MLPs)")),
    ("--moe-k", dict(type=int, default=1, choices=[1, 2], help="experts per token (top-k)")),
    ("--tie-embeddings", dict(action=argparse.BooleanOptionalAction, default=None,
                              help="head tied to the token embedding (default: gpt yes, llama no)")),
    ("--model", dict(help="pkg.module:build_fn, any nn.Module factory (built on meta)")),
]  # fmt: skip
CLUSTER_FLAGS = [
    ("--cluster", dict(default="a100-80g", help=f"{', '.join(PRESETS)}, this-machine or a .json")),
    ("--nodes", dict(type=int, default=1)),
    ("--procs-per-node", dict(type=int, default=None, help="ranks per node (default: preset's)")),
    ("--device-memory", dict(default=None, help="bytes per rank, e.g. 80GiB")),
    ("--peak-tflops", dict(type=float, default=None, help="16-bit TFLOP/s per rank")),
    ("--intra-node-gbps", dict(type=float, default=None, help="GB/s between ranks of a node")),
    ("--inter-node-gbps", dict(type=float, default=None, help="GB/s per rank across nodes")),
    ("--latency-us", dict(type=float, default=None, help="microseconds per collective step")),
]  # fmt: skip
LAYOUT_FLAGS = [("--dp", int), ("--tp", int), ("--pp", int), ("--zero-stage", int),
                ("--micro-batch", int), ("--grad-accum", int), ("--schedule", str),
                ("--ep", int), ("--cp", int), ("--cp-method", str)]  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="rank every layout of a model on a cluster (starts nothing)")
    for flag, opts in MODEL_FLAGS + CLUSTER_FLAGS:
        p.add_argument(flag, **opts)
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS)
    p.add_argument(
        "--async-checkpoint",
        action="store_true",
        help='count the host staging of "checkpoint": {"async": true}',
    )
    for key, what in (
        ("weights", "int8 ZeRO-3 gathers"),
        ("gradients", "int4 ZeRO-2/3 all-to-all"),
    ):
        p.add_argument(
            f"--zero-quantized-{key}",
            action="store_true",
            help=f"ZeRO++: count {what} where the stage allows it (zero_quantized_{key})",
        )
    p.add_argument("--top", type=int, default=10, help="feasible layouts to show")
    p.add_argument("--json", action="store_true", help="every record as JSON")
    p.add_argument("--write-config", metavar="PATH", help="write the best layout's config")
    p.add_argument("--calibrate", action="store_true", help="measure this machine; save it")
    p.add_argument("--calibrate-procs", default="1,2,4", help="process counts to measure")
    p.add_argument("--output", help="where --calibrate saves (default ~/.cache/shardwise)")
    p.add_argument("--simulate", type=int, metavar="RANK", help="set up RANK in a fake world")
    p.add_argument("--plot", metavar="FILE.png", help="draw the top layouts' memory and time")
    p.add_argument("--timeline", metavar="FILE.png", help="draw one step of the best layout")
    for flag, kind in LAYOUT_FLAGS:
        p.add_argument(flag, type=kind, default=None, help="fix this part of the layout")


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The model of ``--model`` (built on meta) or of the shape flags."""
    if args.model:
        fn = _build_fn(args.model)
        with torch.device("meta"):
            return read_model(fn(), name=args.model)
    missing = [f for f in ("layers", "hidden", "heads", "vocab", "seq") if getattr(args, f) is None]
    if missing:
        flags = ", ".join("--" + m for m in missing)
        raise ValueError(f"shardwise plan needs {flags} (or --model pkg.module:build_fn)")
    d = Dims(
        args.layers,
        args.hidden,
        args.heads,
        args.vocab,
        args.seq,
        args.kv_heads,
        args.ffn,
        args.arch,
        args.moe_experts,
        args.moe_k,
        args.tie_embeddings,
    )
    return read_model(build(d), name=f"{args.arch} {d.layers}x{d.hidden}")


def cluster(args: argparse.Namespace) -> Cluster:
    base = load(args.cluster)
    memory = parse_bytes(args.device_memory) if args.device_memory else None
    return with_overrides(
        base,
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        device_memory=memory,
        peak_tflops=args.peak_tflops,
        intra_gbps=args.intra_node_gbps,
        inter_gbps=args.inter_node_gbps,
        latency_us=args.latency_us,
    )


def _fixed(args: argparse.Namespace, lay: Layout) -> bool:
    for flag, _ in LAYOUT_FLAGS:
        name = flag[2:].replace("-", "_")
        want = getattr(args, name)
        if want is not None and getattr(lay, name) != want:
            return False
    return True


def records(args: argparse.Namespace) -> tuple[Planner, list[dict]]:
    shape = model_shape(args)
    for flag in ("seq", "global_batch"):
        if getattr(args, flag) is None:
            raise ValueError(f"shardwise plan needs --{flag.replace('_', '-')}")
    machine = cluster(args)
    opts = Options(async_checkpoint=args.async_checkpoint)
    planner = Planner(shape, machine, args.global_batch, args.seq, args.precision, opts)
    cps = [args.cp] if args.cp is not None else None  # a --model is trusted to call
    # shardwise.attention when --cp is given; the built-in decoders always do
    lays = candidates(
        shape, machine.world, machine.procs_per_node, args.global_batch, None, args.seq, cps
    )
    lays = [_quantized(args, lay) for lay in lays if _fixed(args, lay)]
    return planner, planner.plan(lays)


def _quantized(args: argparse.Namespace, lay: Layout) -> Layout:
    """ZeRO++ on the layouts whose stage has it (weights: 3, not with hpZ, which the config
    refuses for now; gradients: 2 and 3)."""
    qw = args.zero_quantized_weights and lay.zero_stage == 3 and not lay.hpz
    return replace(lay, qw=qw, qg=args.zero_quantized_gradients and lay.zero_stage >= 2)


def _simulate(args: argparse.Namespace) -> dict:
    """--simulate RANK: the layout the flags fix (the rest as the planner ranks best)."""
    planner, recs = records(args)
    fixed = [r for r in recs if r["feasible"]] or recs
    if not fixed:
        raise ValueError("--simulate: no layout matches the flags given")
    lay = Layout(**{k: fixed[0][k] for k in Layout.__dataclass_fields__})
    if not 0 <= args.simulate < lay.world:
        raise ValueError(f"--simulate {args.simulate}: ranks are 0..{lay.world - 1}")
    if args.model:
        fn = _build_fn(args.model)
        with torch.device("meta"):
            model = fn()
    else:
        model = build(planner.shape.dims, ep_size=lay.ep)
    model = simulate.pipeline_model(model, lay.pp)
    engine, _ = simulate.simulate(model, lay, args.simulate, args.precision, planner.shape)
    return simulate.report(engine, planner, lay, args.simulate)


def _build_fn(spec: str) -> Any:
    module_name, _, fn_name = spec.partition(":")
    if not fn_name:
        raise ValueError(f"--model {spec!r}: give pkg.module:build_fn")
    return getattr(importlib.import_module(module_name), fn_name)


def _calibrate(args: argparse.Namespace) -> int:
    """--calibrate: measure, save, say how to use it (calibrate.py)."""
    try:
        procs = [int(n) for n in args.calibrate_procs.split(",")]
    except ValueError:
        raise ValueError(
            f"--calibrate-procs {args.calibrate_procs!r}: give process counts like 1,2,4"
        ) from None
    calibrate.check_output(args.output)  # before a minute of measuring, not after
    data = calibrate.measure(procs, progress=lambda line: print(line, file=sys.stderr))
    path = calibrate.save(data, args.output)
    print(calibrate.describe_errors(data))
    use = "--cluster this-machine" if args.output is None else f"--cluster {path}"
    print(f"calibration saved to {path}; plan with {use}")
    return 0


def _pictures(args: argparse.Namespace, planner: Planner, recs: list[dict]) -> None:
    """--plot: the top layouts side by side; --timeline: one step of the best one (the
    layout the flags fix, the rest as ranked), pictures.py."""
    if args.plot:
        data = pictures.plot_data(recs, planner.cluster.device_memory, min(args.top, 8))
        if not data["names"]:
            raise ValueError("--plot: no feasible layout to draw")
        pictures.draw_plot(data, args.plot)
        print(f"wrote {args.plot}: {len(data['names'])} layouts", file=sys.stderr)
    if args.timeline:
        best = next((r for r in recs if r["feasible"]), None)
        if best is None:
            raise ValueError("--timeline: no feasible layout to draw")
        lay = Layout(**{k: best[k] for k in Layout.__dataclass_fields__})
        pictures.draw_timeline(pictures.timeline_data(planner, lay), args.timeline)
        print(f"wrote {args.timeline}: one step of {lay.name()}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``shardwise plan`` (the parser is ``add_parser``'s)."""
    if args.calibrate:
        return _calibrate(args)
    if args.simulate is not None:
        print(rank_text(_simulate(args)))
        return 0
    planner, recs = records(args)
    if args.json:
        json.dump(recs, sys.stdout, indent=1)
        print()
    else:
        print(table(recs, args.top))
    _pictures(args, planner, recs)
    if args.write_config:
        best = next((r for r in recs if r["feasible"]), None)
        if best is None:
            raise ValueError("--write-config: no feasible layout to write")
        fields = Layout.__dataclass_fields__
        lay = Layout(**{k: best[k] for k in fields})
        cfg = to_config(lay, args.precision, planner.shape)
        Path(args.write_config).write_text(json.dumps(cfg, indent=1) + "\n")
        print(f"wrote {args.write_config}: {lay.name()}", file=sys.stderr)
        if lay.ep > 1:  # a constructor argument, not a config key
            print(f"build the model's MoE layers with ep_size={lay.ep}", file=sys.stderr)
    return 0
