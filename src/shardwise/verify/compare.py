"""A layout's run against the single-process run: where, and by how much, they differ.

The tolerance rule (docs/verify.md). In fp32 a correct layout computes the same sums in
another order (all-reduce, reduce-scatter, split matmuls), so each result differs from the
reference by rounding only: about n x 2^-24 relative for a sum of n terms. The project's
equivalence tests measured at most ~1e-6 relative on losses and norms and ~1e-6 absolute on
parameters (tests/test_tp_engine.py, test_dp.py, test_zero3.py, test_pipe_equivalence.py) and
bound them at 1e-5; so do we:

    loss, gradient norm:  |a - b| <= 1e-6 + 1e-5 |b|           (fp32)
    parameter element:    |a - b| <= 1e-5,  except at most k = s n + 2 sqrt(s n) of a tensor's
                          n elements (s = 0.1%), and no element beyond 5e-3

The share is Adam's: its update m / (sqrt(v) + eps) turns rounding noise on an element whose
gradient nearly cancels into a move of up to lr (design notes: ~4 elements in 100,000 after 8
steps with a correct layout), while a wrong layout moves most elements of a tensor by about lr
per step. The count of such elements is a Poisson-like count of mean at most s n (s is 25x the
measured rate), so k allows its mean plus two standard deviations: a tensor of 1024 elements
may have 3 (RMSprop and Adagrad, whose g / sqrt(v) amplifies noise as Adam's does, moved 2 of
1024 in a correct layout: verify --fuzz), one of 100 none, one of 100,000 about 120. In bf16 (and fp16) every product is rounded to 8 (11) significant bits before fp32
accumulation, and the rounding of a partial sum depends on where the split falls: the
equivalence tests measured 9e-4 on losses, 2e-3 on norms and 1e-3 on parameters, and bound
them at 1e-2 relative and 4e-3 absolute, as here.

The share in bf16 / fp16 is 1%, not 0.1%: there a reduction-order error e is u = 2^-8 (2^-11)
of the products summed, so many more elements have a gradient no larger than e, and
Adagrad, RMSprop and Adam take their first step as lr sign(g) (noise.py), flipping each such
sign by chance. For gradients of spread sigma around 0 and an error of spread e, a sign flips
with probability (1/pi) atan(e / sigma) ~ e / (pi sigma); with e up to 8u sigma (a few
roundings of terms as large as the gradient's spread, in each run) that is 8 / (256 pi) = 1.0%.
Measured (verify --fuzz, bf16 Adagrad, dp4 with and without ZeRO-3): 4 of 1024 (0.4%, e ~ 3u).
A normalizing optimizer can also move one such element further than ``param_max``: the cap is
raised to the bound noise.py derives for the run's optimizer, lr and steps (``for_run``).

A 16-bit loss is itself a 16-bit number, rounded twice: torch's mean cross-entropy of bf16
logits rounds the sum of the tokens' losses to bf16, then the sum / n (each a relative error of
at most u = 2^-8: half an ulp). A layout that splits the tokens (context parallelism; data
ranks) averages in fp32 the losses of its parts, each rounded so, so the two losses differ by
up to 2u + 2u = 4u = 1.56% from these roundings alone, before any difference in the logits
(measured: the same bf16 logits, 32 tokens against 4 parts of 8, differ by up to 3.6u; verify
--fuzz, cp4 in bf16 with and without ZeRO-3: 4.5625 vs 4.5 at step 1, 3.6u). The logits of a
correct layout differ by about u each, moving the cross-entropy (d CE / d z = p - onehot, of
l1 norm <= 2) by about u more: losses are bound at 5u ~ 2e-2 relative (``loss_rel``), norms
keep 1e-2.

Quantized communication (layouts with ``qw`` / ``qg``, ZeRO++) is not exact: every gathered
weight is within eps_w = 1/254 of its block's largest (int8), every travelling gradient element
within eps_g = 1/14 (int4; zero/blockquant.py). To first order (tests/test_zero_quantized.py
derives it) a step's loss moves by at most 2 L eps_w for L layers in sequence, plus eps_g of the
loss decrease so far: for a few layers (L = 3) and a short run, 2.4% + 3.6% = 6% of the loss,
and the gradient norm as much. Parameters are checked coarsely (5e-2 per element): int4 noise
moves every small gradient element, which Adam turns into moves of up to lr per step; the loss
curve is the check. The tests measured 0.7% (losses, 30 steps) and 1.5e-3 (parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from shardwise.verify.noise import noise_move, noise_share
from shardwise.verify.results import RunResult


@dataclass(frozen=True)
class Tolerance:
    """Bounds of one precision (see the module docstring for the measurements behind them)."""

    name: str
    rel: float  # losses and norms, relative to the reference
    abs: float  # losses and norms, absolute floor
    param: float  # one parameter element
    param_max: float  # no element beyond this, whatever the share
    share: float = 1e-3  # elements allowed beyond ``param`` (Adam's amplified noise)
    loss_rel: float | None = None  # losses, when not ``rel`` (a 16-bit loss: 5u)

    def close(self, got: float, want: float, rel: float | None = None) -> bool:
        return abs(got - want) <= self.abs + (self.rel if rel is None else rel) * abs(want)

    def allowed(self, n: int) -> int:
        """Elements of an ``n``-element tensor allowed beyond ``param``: the mean share plus two
        standard deviations of a Poisson count (the module docstring)."""
        mean = self.share * n
        return int(mean + 2 * math.sqrt(mean))


FP32 = Tolerance("fp32", rel=1e-5, abs=1e-6, param=1e-5, param_max=5e-3)
BF16 = Tolerance("bf16", rel=1e-2, abs=1e-6, param=4e-3, param_max=5e-2, share=1e-2, loss_rel=2e-2)
QUANTIZED = Tolerance("quantized", rel=6e-2, abs=1e-6, param=5e-2, param_max=5e-2)
TOLERANCES = {"fp32": FP32, "bf16": BF16, "fp16": BF16, "quantized": QUANTIZED}


def tolerance_for(config: dict, steps: int) -> Tolerance:
    """bf16 / fp16 bounds when the config trains in 16 bits, else fp32's (``for_run``)."""
    for key in ("bf16", "fp16"):
        if isinstance(config.get(key), dict) and config[key].get("enabled"):
            return for_run(TOLERANCES[key], config, steps)
    return for_run(FP32, config, steps)


def for_run(tol: Tolerance, config: dict, steps: int) -> Tolerance:
    """``tol`` with its cap raised to how far the config's optimizer can move one element on
    rounding noise over ``steps`` steps, and its share to the share of elements such moves
    reach (noise.py: Adagrad and RMSprop)."""
    return replace(
        tol,
        param_max=max(tol.param_max, noise_move(config, steps)),
        share=max(tol.share, noise_share(config, steps)),
    )


@dataclass
class Verdict:
    """How one layout compares; ``diverged`` decides the exit code."""

    layout: str
    procs: int
    loss_diffs: list[float] = field(default_factory=list)
    norm_diffs: list[float | None] = field(default_factory=list)
    max_param_diff: float = 0.0
    findings: list[str] = field(default_factory=list)  # the first one names what went wrong
    first_param: str | None = None  # the first parameter beyond the tolerance
    first_step: int | None = None  # and the step where it crossed it
    unjudged: list[str] = field(default_factory=list)  # zero gradient in one process

    @property
    def diverged(self) -> bool:
        return bool(self.findings)


def param_beyond(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> str | None:
    """Why ``got`` is beyond the tolerance of ``want``, or None."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    diff = (got - want).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    beyond = int((diff > tol.param).sum())
    if worst > tol.param_max or beyond > tol.allowed(diff.numel()):
        return f"max |diff| {worst:.1e}, {beyond} of {diff.numel()} elements beyond {tol.param:.0e}"
    return None


def _series(verdict: Verdict, got: RunResult, want: RunResult, tol: Tolerance) -> None:
    for step, (a, b) in enumerate(zip(got.losses, want.losses, strict=True), 1):
        verdict.loss_diffs.append(abs(a - b))
        if not tol.close(a, b, tol.loss_rel) and not any(
            f.startswith("loss") for f in verdict.findings
        ):
            verdict.findings.append(f"loss at step {step}: {a:.6g} vs {b:.6g}")
    for step, (a, b) in enumerate(zip(got.norms, want.norms, strict=True), 1):
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            verdict.norm_diffs.append(None)
            continue
        verdict.norm_diffs.append(abs(a - b))
        if not tol.close(a, b) and not any(f.startswith("grad") for f in verdict.findings):
            verdict.findings.append(f"grad norm at step {step}: {a:.6g} vs {b:.6g}")


def _params(verdict: Verdict, got: RunResult, want: RunResult, tol: Tolerance) -> None:
    for step, (mine, ref) in enumerate(zip(got.params, want.params, strict=True), 1):
        for name in want.names:
            if name in want.zero_grad and name in mine:
                continue  # rounding noise in both runs, amplified by Adam (gradients.py)
            if name not in mine:
                why = "missing from the layout's consolidated state"
            else:
                diff = (
                    (mine[name] - ref[name]).abs() if mine[name].shape == ref[name].shape else None
                )
                if diff is not None and diff.numel():
                    verdict.max_param_diff = max(verdict.max_param_diff, float(diff.max()))
                why = param_beyond(mine[name], ref[name], tol)
            if why is not None and verdict.first_param is None:
                verdict.first_param, verdict.first_step = name, step
                verdict.findings.append(f"parameter {name} at step {step}: {why}")


def compare(got: RunResult, want: RunResult, tol: Tolerance, procs: int) -> Verdict:
    """Every step's loss and gradient norm, every parameter after every step, and the random
    streams; the findings name the first step and the first parameter (model order)."""
    verdict = Verdict(got.layout, procs)
    if len(got.losses) != len(want.losses):
        verdict.findings.append(f"ran {len(got.losses)} steps, the reference {len(want.losses)}")
        return verdict
    _series(verdict, got, want, tol)
    verdict.unjudged = list(want.zero_grad)
    _params(verdict, got, want, tol)
    verdict.findings += got.streams
    return verdict


def still(result: RunResult, initial: dict[str, torch.Tensor]) -> bool:
    """True when no parameter of the run moved from ``initial``: the comparison is then void
    (an lr of 0, a warmup from 0, every parameter frozen)."""
    last = result.params[-1] if result.params else {}
    return all(torch.equal(last[n], initial[n].float()) for n in result.names if n in initial)


def failed(layout: str, procs: int, why: str) -> Verdict:
    """A layout that did not run to the end (its error is the finding)."""
    return Verdict(layout, procs, findings=[f"did not run: {why}"])
