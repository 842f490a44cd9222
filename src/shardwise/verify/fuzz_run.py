"""``shardwise verify --fuzz N --seed S``: run drawn cases, each refused or matching one process.

Each case ends in one of three outcomes:

    ok        it ran in its layout and matched the one-process reference (verify's comparison
              and tolerances, compare.py)
    refused   the library refused it before training: in this process, by the config's own
              validation (``precheck``), or in ``initialize`` on the workers; the message names
              the offending key (a ConfigError's ``key``, or a dotted config path or MoE argument
              of the case written in the message)
    finding   anything else: a refusal that names no key, an error after training started, a
              crash (any other exception, a worker that died), a hang (no result within the
              timeout) or a mismatch. Printed with the command that replays it.

The reference of a case runs once per ``reference_key`` (model, options, config without the
layout, rows) and is reused by every case of the run with the same key.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardwise.config import parse_config
from shardwise.topology import Topology
from shardwise.training.refusals import refuse_unimplemented
from shardwise.verify.compare import compare, tolerance_for
from shardwise.verify.fuzz_setup import case_layout, case_setup, default_script
from shardwise.verify.fuzz_space import (
    Case,
    draw_cases,
    from_json,
    layout_blocks,
    reference_key,
    train_config,
)
from shardwise.verify.layout_names import Layout, layout_config, reference_for
from shardwise.verify.results import RESULT_JSON, RunResult, load_result
from shardwise.verify.setup import VerifySetup, batch_rows
from shardwise.verify.worker import (
    build_engine,
    setup_batches,
    train_layout,
    worker_command,
    write_initial_weights,
)

REFUSALS = (ValueError, NotImplementedError)  # what a refusal raises (ConfigError is a ValueError)
ERROR_FILE = "error.json"
TAIL = 8  # lines of a crashed worker's stderr shown in its finding


@dataclass
class Failure(Exception):
    """A run that raised: in which phase ("initialize" or "training"), what and where."""

    phase: str
    kind: str  # the exception's class name
    message: str
    key: str = ""  # a ConfigError's key
    refusal: bool = False  # a ValueError / NotImplementedError

    @classmethod
    def of(cls, phase: str, error: BaseException) -> Failure:
        return cls(
            phase, type(error).__name__, str(error), getattr(error, "key", "") or "",
            isinstance(error, REFUSALS),
        )  # fmt: skip


@dataclass
class Outcome:
    """What became of one case: ``kind`` is ok, refused or finding; ``detail`` says why."""

    case: Case
    kind: str
    detail: str = ""


def run_phased(setup: VerifySetup, layout: Layout, steps: int, init: Path, out: Path | None) -> RunResult:  # fmt: skip
    """verify's run of ``layout`` (worker.py), its errors tagged with the phase they came in."""
    try:
        batches = setup_batches(setup, steps)
        built = build_engine(setup, layout, init, batch_rows(batches[0]))
    except Exception as e:  # every error is classified, none lost
        raise Failure.of("initialize", e) from e
    try:
        return train_layout(setup, layout, batches, built, out)
    except Exception as e:
        raise Failure.of("training", e) from e


def run_case_worker(script: str, entry: str, text: str, steps: int, init: str, out: str) -> None:
    """One rank of a case's layout (``fuzz_worker.py``); an error is written for the parent
    (``error.json`` of the lowest failing rank wins) and raised again."""
    case = from_json(text)
    try:
        try:
            setup = case_setup(case, script, entry, layout_side=True)
        except Exception as e:
            raise Failure.of("initialize", e) from e
        run_phased(setup, case_layout(case), steps, Path(init), Path(out))
    except Failure as f:
        Path(out).mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        (Path(out) / f"error.{rank}.json").write_text(json.dumps(f.__dict__))
        raise


def _paths(block: object, prefix: str = "") -> set[str]:
    """Every dotted key path of a config dict."""
    if not isinstance(block, dict):
        return set()
    out = set()
    for k, v in block.items():
        path = f"{prefix}.{k}" if prefix else k
        out |= {path} | _paths(v, path)
    return out


def named_key(failure: Failure, config: dict, case: Case) -> str | None:
    """The key a refusal names: the ConfigError's, else the longest dotted config path (or key
    with an underscore) or MoE argument of the case written in the message."""
    if failure.key:
        return failure.key
    names = _paths(config) | set(case.moe) | ({"ep_size"} if case.model == "gpt-moe" else set())
    for name in sorted(names, key=len, reverse=True):
        if ("." in name or "_" in name) and name in failure.message:
            return name
    return None


def classify(failure: Failure, config: dict, case: Case) -> Outcome:
    """A refusal before training that names a key is ``refused``; any other failure a finding."""
    first = failure.message.strip().splitlines()[0] if failure.message.strip() else ""
    if failure.phase != "initialize":
        return Outcome(case, "finding", f"{failure.kind} after training started: {first}")
    if not failure.refusal:
        return Outcome(case, "finding", f"crash in initialize: {failure.kind}: {first}")
    key = named_key(failure, config, case)
    if key is None:
        return Outcome(case, "finding", f"refusal naming no config key: {failure.kind}: {first}")
    return Outcome(case, "refused", first if first.startswith(key) else f"{key}: {first}")


def precheck(case: Case, setup: VerifySetup) -> dict:
    """The layout's config, checked in this process by the library's own validation (no
    process, no tensor): raises the ConfigError / TopologyError of a refused case."""
    config = layout_config(setup.config, case_layout(case), case.rows)
    cfg = parse_config(config)
    refuse_unimplemented(cfg, None)
    Topology.build(case.world, pp=case.pp, tp=case.tp, cp=case.cp, zero_shard=case.mics)
    cfg.resolve_batch(case.dp)
    return config


class Fuzzer:
    """Runs cases one after another; references cached by ``reference_key``."""

    def __init__(self, script: str | None, entry: str, steps: int, timeout: float, work: Path):
        self.script, self.entry, self.steps, self.timeout = script, entry, steps, timeout
        self.work = work
        self.references: dict[str, tuple[Path, RunResult | Failure]] = {}
        self.launched = 0  # each launch writes to its own directory

    def reference(self, case: Case) -> tuple[Path, RunResult | Failure]:
        """(initial weights, the one-process result or its Failure), once per key."""
        key = reference_key(case)
        if key not in self.references:
            init = self.work / f"init{len(self.references)}.safetensors"
            torch.set_num_threads(1)  # as each worker: the same sums in the same order
            try:
                try:
                    setup = case_setup(case, self.script, self.entry, layout_side=False)
                    write_initial_weights(setup, init)
                except Exception as e:
                    raise Failure.of("initialize", e) from e
                ref = reference_for(case_layout(case), bool(case.moe))
                result: RunResult | Failure = run_phased(setup, ref, self.steps, init, None)
            except Failure as f:
                result = f
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
            self.references[key] = (init, result)
        return self.references[key]

    def run(self, case: Case) -> Outcome:
        """The outcome of one case (see the module docstring)."""
        try:
            setup = case_setup(case, self.script, self.entry, layout_side=True)
            config = precheck(case, setup)
        except Exception as e:
            return classify(Failure.of("initialize", e), case_setup_config(case), case)
        init, want = self.reference(case)
        if isinstance(want, Failure):
            return classify(want, config, case)
        self.launched += 1
        out = self.work / f"case{self.launched}"
        got = self._launch(case, init, out)
        if isinstance(got, Outcome):
            return got
        if isinstance(got, Failure):
            return classify(got, config, case)
        verdict = compare(got, want, tolerance_for(config, self.steps), case.world)
        if verdict.diverged:
            return Outcome(case, "finding", "mismatch: " + "; ".join(verdict.findings[:3]))
        return Outcome(case, "ok", f"max |dloss| {max(verdict.loss_diffs):.1e}")

    def _launch(self, case: Case, init: Path, out: Path) -> RunResult | Failure | Outcome:
        script = str(self.script or default_script())
        args = [script, "--case", case.to_json(), "--steps", str(self.steps)]
        args += ["--init", str(init), "--out", str(out), "--entry", self.entry]
        cmd = worker_command(case.world, args, module="shardwise.verify.fuzz_worker")
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired as e:
            said = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
            tail = " | ".join((said or "").strip().splitlines()[-TAIL:])
            return Outcome(case, "finding", f"hang: no result within {self.timeout:.0f}s: {tail}")
        errors = sorted(out.glob("error.*.json"), key=lambda p: int(p.name.split(".")[1]))
        if errors:
            return Failure(**json.loads(errors[0].read_text()))
        if done.returncode != 0 or not (out / RESULT_JSON).is_file():
            tail = " | ".join(done.stderr.strip().splitlines()[-TAIL:])
            return Outcome(case, "finding", f"worker crash, exit code {done.returncode}: {tail}")
        return load_result(out)


def case_setup_config(case: Case) -> dict:
    """The case's config as the layout side sees it, without loading any model."""
    return {**train_config(case), **layout_blocks(case)}


def replay(case: Case, script: str | None) -> str:
    """The command that runs ``case`` again, to paste in a shell."""
    where = f" {script}" if script else ""
    return f"shardwise verify{where} --fuzz-case '{case.to_json()}'"


def run_cases(cases: list[tuple[str, Case]], fuzzer: Fuzzer, script: str | None) -> int:
    """Run and print every case; 1 if any is a finding, else 0."""
    findings = []
    for label, case in cases:
        print(f"{label}: {case.summary()} | replay: {replay(case, script)}", flush=True)
        try:
            outcome = fuzzer.run(case)
        except Exception as e:  # the fuzzer's own failure is a finding too, never a crash
            outcome = Outcome(case, "finding", f"fuzzer error: {traceback.format_exc(limit=3)}{e}")
        print(f"  {outcome.kind}: {outcome.detail}", flush=True)
        if outcome.kind == "finding":
            findings.append((label, outcome))
    print(f"\nfuzz: {len(cases)} cases, {len(findings)} findings", flush=True)
    for label, outcome in findings:
        print(f"  {label}: {outcome.detail}\n    {replay(outcome.case, script)}")
    return 1 if findings else 0


def fuzz_command(args: object) -> int:
    """``--fuzz N --seed S [--fuzz-index I]`` or ``--fuzz-case JSON``."""
    if args.fuzz_case:
        cases = [("case", from_json(args.fuzz_case))]
    else:
        start = args.fuzz_index or 0
        drawn = draw_cases(args.seed, start + args.fuzz)
        cases = [(f"seed {args.seed} case {i}", drawn[i]) for i in range(start, len(drawn))]
    steps = args.steps or 3
    timeout = args.layout_timeout or 240
    with tempfile.TemporaryDirectory(prefix="shardwise-fuzz-") as tmp:
        fuzzer = Fuzzer(args.script, args.entry, steps, timeout, Path(tmp))
        return run_cases(cases, fuzzer, args.script)
