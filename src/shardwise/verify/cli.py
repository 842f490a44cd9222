"""``shardwise verify script.py --layouts dp2,zero3x2,tp2,pp2,dp2xtp2 --steps 5 [--compile]``.

Order of work: every flag and layout is checked, and the script's setup loaded and checked
against each layout, before anything launches. Then the initial weights are written, the
single-process reference trains in this process, and each layout runs as real workers through
``shardwise run`` (the project's launcher); their results are compared with the reference.
Exit code 0 when every layout matches, 1 when any diverges or fails, 2 for a bad command.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.verify.compare import (
    QUANTIZED,
    TOLERANCES,
    Verdict,
    compare,
    failed,
    for_run,
    still,
    tolerance_for,
)
from shardwise.verify.fuzz_run import fuzz_command
from shardwise.verify.layout_names import (
    EXAMPLE,
    REFERENCE,
    Layout,
    LayoutError,
    check_batch,
    parse_layouts,
    reference_for,
)
from shardwise.verify.report import render
from shardwise.verify.results import RESULT_JSON, RunResult, load_result, load_weights
from shardwise.verify.setup import DEFAULT_ENTRY, VerifySetup, batch_rows, load_setup
from shardwise.verify.support_matrix import render_matrix
from shardwise.verify.worker import (
    per_rank_statistics,
    run_reference,
    worker_command,
    write_initial_weights,
)

NOT_MOVED = "no parameter moved in the reference run (lr 0 or a warmup from 0?): give more steps"
ERROR_TAIL = 12  # lines of a failed layout's stderr shown in its finding


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="train a script in several layouts and compare each with one process"
    )
    p.add_argument(
        "script",
        nargs="?",
        help="training script defining the entry point (docs/verify.md); --fuzz: the example GPT",
    )
    p.add_argument("--layouts", help=f"comma-separated, e.g. {EXAMPLE}")
    p.add_argument("--steps", type=int, help="optimizer steps per layout (default 5; --fuzz 3)")
    p.add_argument("--entry", default=DEFAULT_ENTRY, help="the script's entry point function")
    p.add_argument(
        "--tolerance",
        choices=sorted(TOLERANCES),
        help="bounds to use (default: the config's precision)",
    )
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help="compile every layout as its config would (per block, or the whole model under "
        "DP and ZeRO-1/2; default backend inductor; docs/compile.md); "
        "the reference stays eager",
    )
    p.add_argument("--out", help="keep every run's files here (default: a temporary directory)")
    p.add_argument(
        "--layout-timeout", type=float, help="seconds per layout run (default 600; --fuzz 240)"
    )
    fuzz = p.add_argument_group("fuzzing (docs/verify.md, 'Fuzzing layouts')")
    fuzz.add_argument("--fuzz", type=int, metavar="N", help="draw N configurations and run each")
    fuzz.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    fuzz.add_argument("--fuzz-index", type=int, metavar="I", help="with --fuzz: from draw I on")
    fuzz.add_argument("--fuzz-case", metavar="JSON", help="run one case as the fuzzer printed it")
    fuzz.add_argument(
        "--support-matrix", action="store_true", help="print docs/support-matrix.md (no training)"
    )


def check(args: argparse.Namespace) -> tuple[list[Layout], VerifySetup]:
    """Everything that can be refused before a process starts, refused."""
    if args.script is None or args.layouts is None:
        raise LayoutError(
            "verify needs a SCRIPT and --layouts (or --fuzz N, --fuzz-case, --support-matrix)"
        )
    args.steps = 5 if args.steps is None else args.steps
    args.layout_timeout = 600 if args.layout_timeout is None else args.layout_timeout
    if args.steps < 1:
        raise LayoutError(f"--steps {args.steps}: give at least 1 step")
    if args.layout_timeout <= 0:
        raise LayoutError(f"--layout-timeout {args.layout_timeout}: give seconds > 0")
    layouts = parse_layouts(args.layouts)
    setup = load_setup(args.script, args.entry)
    first = next(iter(setup.batches()), None)
    if first is None:
        raise ValueError(f"{args.script}: the setup's batches are empty")
    for layout in layouts:
        check_batch(layout, batch_rows(first), setup.gas)
        if layout.pp > 1 and setup.pipeline is None:
            raise LayoutError(
                f"--layouts {layout.name}: the setup has no 'pipeline' builder; add "
                "'pipeline': lambda model: PipelineModule(...) to it, or drop the ppN layouts"
            )
    return layouts, setup


def check_fuzz(args: argparse.Namespace) -> None:
    """The fuzzing flags, refused before anything runs."""
    if args.layouts is not None:
        raise LayoutError("--layouts with --fuzz: the fuzzer draws the layouts; give one of them")
    if args.fuzz is not None and args.fuzz_case is not None:
        raise LayoutError("--fuzz with --fuzz-case: give N draws or one case, not both")
    if args.fuzz is not None and args.fuzz < 1:
        raise LayoutError(f"--fuzz {args.fuzz}: draw at least 1 configuration")
    if args.fuzz_index is not None and (args.fuzz is None or args.fuzz_index < 0):
        raise LayoutError("--fuzz-index I needs --fuzz N and I >= 0")
    if args.steps is not None and args.steps < 1:
        raise LayoutError(f"--steps {args.steps}: give at least 1 step")


def _launch(args: argparse.Namespace, layout: Layout, init: Path, out: Path) -> Verdict | None:
    """Run ``layout`` through ``shardwise run``; a Verdict when it failed, else None."""
    worker = [str(args.script), "--layout", layout.name, "--steps", str(args.steps)]
    if getattr(args, "compile", None):
        worker += ["--compile", args.compile]
    cmd = worker_command(layout.world, worker + ["--init", str(init), "--out", str(out), "--entry", args.entry])  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.layout_timeout)
    except subprocess.TimeoutExpired:
        return failed(layout.name, layout.world, f"no result within {args.layout_timeout:.0f}s")
    if done.returncode != 0 or not (out / RESULT_JSON).is_file():
        tail = "\n      ".join(done.stderr.strip().splitlines()[-ERROR_TAIL:])
        return failed(layout.name, layout.world, f"exit code {done.returncode}\n      {tail}")
    return None


def _reference(setup: VerifySetup, steps: int, init: Path, layout: Layout = REFERENCE) -> RunResult:
    """The single-process run, in this process, then its process group released."""
    torch.set_num_threads(1)  # as each worker: one thread, the same sums in the same order
    if not init.is_file():
        write_initial_weights(setup, init)
    try:
        return run_reference(setup, steps, init, layout)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    """The verify command: print the report; 1 if any layout diverged, else 0."""
    if args.support_matrix:
        print(render_matrix(), end="")
        return 0
    if any(v is not None for v in (args.fuzz, args.fuzz_case, args.fuzz_index)):
        check_fuzz(args)
        return fuzz_command(args)
    layouts, setup = check(args)
    tol = tolerance_for(setup.config, args.steps)
    if args.tolerance:
        tol = for_run(TOLERANCES[args.tolerance], setup.config, args.steps)
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="shardwise-verify-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"verify: reference run, 1 process, {args.steps} steps", file=sys.stderr, flush=True)
        init = work / "init.safetensors"
        init.unlink(missing_ok=True)  # a rerun with --out writes the weights afresh
        want = {REFERENCE: _reference(setup, args.steps, init)}
        if still(want[REFERENCE], load_weights(init)):
            print(f"verify: warning: {NOT_MOVED}", file=sys.stderr, flush=True)
        per_rank = per_rank_statistics(setup)
        verdicts = []
        for layout in layouts:
            ref = reference_for(layout, per_rank)
            if ref not in want:  # MoE: the one process that sees each rank's rows together
                print(f"verify: reference run, {ref.name}", file=sys.stderr, flush=True)
                want[ref] = _reference(setup, args.steps, init, ref)
            how = f", compiled ({args.compile})" if getattr(args, "compile", None) else ""
            print(
                f"verify: {layout.name}, {layout.world} processes{how}", file=sys.stderr, flush=True
            )
            out = work / layout.name
            shutil.rmtree(out, ignore_errors=True)  # a rerun with --out never reads stale files
            verdict = _launch(args, layout, init, out)
            # quantized layouts: their own tolerance unless --tolerance chose one (compare.py)
            mine = QUANTIZED if layout.quantized and not args.tolerance else tol
            verdicts.append(verdict or compare(load_result(out), want[ref], mine, layout.world))
    finally:
        if not args.out:
            shutil.rmtree(work, ignore_errors=True)
    print(render(args.script, args.steps, tol, verdicts))
    if any(layout.quantized for layout in layouts) and not args.tolerance:
        q = QUANTIZED  # the rule of compare.py's docstring
        print(
            f"quantized layouts (qw, qg): {q.name} tolerance, loss and grad norm |diff| <= "
            f"{q.abs:.0e} + {q.rel:.0e} |reference|, parameters within {q.param_max:.0e}"
        )
    return 1 if any(v.diverged for v in verdicts) else 0
