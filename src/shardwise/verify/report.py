"""The text ``shardwise verify`` prints: one row per layout, the per-step differences, and
every finding of the layouts that diverged."""

from __future__ import annotations

from collections.abc import Sequence

from shardwise.verify.compare import Tolerance, Verdict


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def _max(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _series_bounds(tol: Tolerance) -> str:
    if tol.loss_rel is None:
        return f"loss and grad norm: |diff| <= {tol.abs:.0e} + {tol.rel:.0e} |reference|"
    return (
        f"loss: |diff| <= {tol.abs:.0e} + {tol.loss_rel:.0e} |reference|, grad norm: "
        f"{tol.abs:.0e} + {tol.rel:.0e} |reference|"
    )


def header(script: str, steps: int, tol: Tolerance) -> str:
    return (
        f"shardwise verify {script}: {steps} steps, each layout against one process, "
        f"{tol.name} tolerance\n({_series_bounds(tol)}; parameters: |diff| <= {tol.param:.0e} per element, at most "
        f"{tol.share:.1%} of a tensor's elements (+ 2 sigma) beyond it, none beyond "
        f"{tol.param_max:.0e})"
    )


def table(verdicts: Sequence[Verdict]) -> str:
    rows = [("layout", "procs", "max |dloss|", "max |dnorm|", "max |dparam|", "first parameter beyond tolerance", "result")]  # fmt: skip
    for v in verdicts:
        first = f"{v.first_param} (step {v.first_step})" if v.first_param else "-"
        rows.append(
            (
                v.layout,
                str(v.procs),
                _e(_max(v.loss_diffs)),
                _e(_max(v.norm_diffs)),
                _e(v.max_param_diff) if v.loss_diffs else "-",
                first,
                "DIVERGED" if v.diverged else "ok",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def per_step(verdicts: Sequence[Verdict]) -> str:
    width = max(len(v.layout) for v in verdicts)
    lines = ["loss |diff| per step (grad norm |diff| below):"]
    for v in verdicts:
        if v.loss_diffs:
            lines.append(f"  {v.layout.ljust(width)}  {' '.join(_e(d) for d in v.loss_diffs)}")
            lines.append(f"  {''.ljust(width)}  {' '.join(_e(d) for d in v.norm_diffs)}")
    return "\n".join(lines)


def render(script: str, steps: int, tol: Tolerance, verdicts: Sequence[Verdict]) -> str:
    """The whole report; the last line says whether any layout diverged."""
    parts = [header(script, steps, tol), table(verdicts), per_step(verdicts)]
    unjudged = sorted({n for v in verdicts for n in v.unjudged})
    if unjudged:
        parts.append(
            f"not judged: {', '.join(unjudged)} (gradient zero up to rounding in one process: "
            "an optimizer like Adam moves it by up to lr on noise alone; it cannot move the loss)"
        )
    bad = [v for v in verdicts if v.diverged]
    if bad:
        findings = ["findings:"] + [f"  {v.layout}: {f}" for v in bad for f in v.findings]
        parts.append("\n".join(findings))
        parts.append(f"verify: {len(bad)} of {len(verdicts)} layouts diverged from one process")
    else:
        parts.append(f"verify: all {len(verdicts)} layouts train like one process")
    return "\n\n".join(parts)
