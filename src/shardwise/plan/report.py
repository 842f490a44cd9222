"""``shardwise plan``'s table: one row per layout, best first; the infeasible ones with why."""

from __future__ import annotations

from typing import Any

from shardwise.plan.cluster import GIB

COLUMNS = (
    ("#", lambda i, r: str(i)),
    ("dp", lambda i, r: str(r["dp"])),
    ("tp", lambda i, r: f"{r['tp']}{'+sp' if r['sequence_parallel'] else ''}"),
    ("cp", lambda i, r: str(r["cp"]) + (f" {r['cp_method']}" if r["cp"] > 1 else "")),
    ("ep", lambda i, r: str(r["ep"])),
    ("pp", lambda i, r: str(r["pp"]) + ("" if r["schedule"] == "1f1b" else f" {r['schedule']}")),
    ("zero", lambda i, r: " ".join(_zero(r))),
    ("mb x gas", lambda i, r: f"{r['micro_batch']}x{r['grad_accum']}"),
    ("ckpt", lambda i, r: "yes" if r["activation_checkpointing"] else "-"),
    ("offload", lambda i, r: "cpu" if r["offload"] else "-"),
    ("params", lambda i, r: _gib(r["memory"]["params"])),
    ("grads", lambda i, r: _gib(r["memory"]["grads"])),
    ("optim", lambda i, r: _gib(r["memory"]["optimizer"])),
    ("activ", lambda i, r: _gib(r["memory"]["activations"])),
    ("buffers", lambda i, r: _gib(r["memory"]["buffers"])),
    ("peak GiB", lambda i, r: _gib(r["memory"]["peak"])),
    ("comm d/t/p/e/c GiB", lambda i, r: "/".join(_gib(v) for v in r["comm_bytes"].values())),
    ("bubble", lambda i, r: f"{r['bubble']:.2f}"),
    ("step s", lambda i, r: _sec(r["step_time_s"]) + ("*" if r.get("estimate") else "")),
    ("cmp/comm/bub", lambda i, r: "/".join(_sec(v) for v in r["time"].values())),
    ("tok/s", lambda i, r: f"{r['tokens_per_s']:,.0f}"),
    ("MFU", lambda i, r: f"{r['mfu']:.1%}"),
)
# Host memory of asynchronous checkpoints (--async-checkpoint): shown when counted.
STAGING = ("stage GiB", lambda i, r: _gib(r["memory"]["checkpoint_staging"]))


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}" if n < 10 * GIB else f"{n / GIB:.1f}"


def _sec(t: float) -> str:
    return f"{t:.3g}"


def table(records: list[dict[str, Any]], top: int, infeasible: int = 5) -> str:
    """The ``top`` feasible layouts, then up to ``infeasible`` of the others with reasons."""
    ok = [r for r in records if r["feasible"]][:top]
    staged = any(r["memory"].get("checkpoint_staging") for r in ok)
    at = [c[0] for c in COLUMNS].index("peak GiB") + 1
    cols = COLUMNS[:at] + (STAGING,) + COLUMNS[at:] if staged else COLUMNS
    rows = [[c[0] for c in cols]] + [[f(i, r) for _, f in cols] for i, r in enumerate(ok, 1)]
    widths = [max(len(row[k]) for row in rows) for k in range(len(cols))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    total = sum(r["feasible"] for r in records)
    lines.insert(0, f"{total} feasible layouts of {len(records)}; the {len(ok)} fastest:")
    if not ok:
        lines[0] = f"no feasible layout among {len(records)}"
    if any(r.get("estimate") for r in ok):
        guessed = sorted({k for r in ok for k in r["estimated"]})
        lines.append(
            f"* estimate: rests on unmeasured cluster numbers ({', '.join(guessed)}); "
            "docs/planner.md says where each comes from, --calibrate measures this machine"
        )
    bad = [r for r in records if not r["feasible"]]
    if bad and infeasible:
        lines += ["", f"{len(bad)} infeasible, for example:"]
        for r in bad[:infeasible]:
            name = (
                f"dp{r['dp']} tp{r['tp']}{'+sp' if r['sequence_parallel'] else ''} "
                + (f"cp{r['cp']} {r['cp_method']} " if r["cp"] > 1 else "")
                + (f"ep{r['ep']} " if r["ep"] > 1 else "")
                + f"pp{r['pp']} "
                f"zero{r['zero_stage']} mb{r['micro_batch']}x{r['grad_accum']}"
                f"{' ckpt' if r['activation_checkpointing'] else ''}"
                f"{' offload' if r['offload'] else ''}"
                f"{'' if r['schedule'] == '1f1b' else ' ' + r['schedule']}"
            )
            lines.append(f"  {name}: {r['reason']}")
    return "\n".join(lines)


def rank_text(view: dict[str, Any]) -> str:
    """``shardwise plan --simulate RANK``: what that rank would hold and send."""
    lines = [f"rank {view['rank']} of {view['world']}: {view['coords']}"]
    lines.append(f"  layout {view['layout']}")
    lines.append(f"  stage {view['stage']}: layers {view['layers'][0]}-{view['layers'][1] - 1}")
    m, held = view["memory"], view["held"]
    lines.append(
        "  predicted at the step: "
        + ", ".join(f"{k} {m[k]:,} B" for k in ("params", "grads", "optimizer"))
        + f"; activations {m['activations']:,} B; peak {m['peak']:,} B"
    )
    lines.append(
        "  held after the simulated setup (no step yet: optimizer = fp32 masters): "
        + ", ".join(f"{k} {held[k]:,} B" for k in ("params", "grads", "optimizer"))
    )
    lines.append("  parameters as this rank holds them:")
    for name, shape in view.get("shards", [])[:12]:
        lines.append(f"    {name}: {tuple(shape)}")
    more = len(view.get("shards", [])) - 12
    if more > 0:
        lines.append(f"    ... {more} more")
    lines.append("  predicted collectives per step:")
    for op, e in view["comm_ops"].items():
        lines.append(f"  {op}: {e['calls']} calls, {e['bytes']:,} B, {e['sent_bytes']:,} B sent")
    return "\n".join(lines)


def _zero(r: dict) -> list[str]:
    """The stage, then MiCS's shard group, hpZ's secondary group and ZeRO++'s quantized
    weights / gradients, those that are on."""
    parts = [str(r["zero_stage"])] + [f"{k}{r[k]}" for k in ("mics", "hpz") if r.get(k)]
    return parts + [k for k in ("qw", "qg") if r.get(k)]
