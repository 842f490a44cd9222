"""The text of DeepSpeed's flops profile (``print_model_profile``), from a FlopsProfiler.

Latencies: ``fwd latency`` is the profiled forward's own (the root module's hooks); with
``wall_clock_breakdown`` the backward and step of the profiled step come from the engine's
timers, and the FLOPS lines DeepSpeed derives from them follow (backward = (2 +
recompute_fwd_factor) x forward FLOPs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.monitor.flops import FlopsProfiler, number

if TYPE_CHECKING:  # annotations only
    from shardwise.monitor.timers import WallClock
    from shardwise.training.parts import TrainParts

_RULE = "-" * 78
_NOTATIONS = (
    "Notations:\n"
    "data parallel size (dp_size), model parallel size(mp_size),\n"
    "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
    "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
    "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
    "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n"
)


def _row(label: str, value: object) -> str:
    return f"{label:<70}  {value!s:<8}"


def _timings(
    prof: FlopsProfiler, parts: TrainParts, clock: WallClock | None, fwd: float
) -> list[str]:
    """DeepSpeed's backward / step / iteration lines (with wall_clock_breakdown only)."""
    if clock is None or not clock.last.get("bwd"):
        return []
    flops = prof.get_total_flops()
    factor = 2 + prof.cfg.recompute_fwd_factor
    bwd, step = clock.last["bwd"], clock.last.get("step", 0.0)
    it = fwd + bwd + step
    samples = parts.batch.micro_batch_size * parts.mesh.topology.world_size
    return [
        _row("bwd latency: ", number(bwd, "s")),
        _row(
            f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
            number(factor * flops / bwd, "FLOPS"),
        ),
        _row(
            f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
            number((factor + 1) * flops / (fwd + bwd), "FLOPS"),
        ),
        _row("step latency: ", number(step, "s")),
        _row("iter latency: ", number(it, "s")),
        _row(
            f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
            number((factor + 1) * flops / it, "FLOPS"),
        ),
        _row("samples/second: ", round(samples / it, 2)),
    ]


def profile_report(prof: FlopsProfiler, parts: TrainParts, clock: WallClock | None = None) -> str:
    """The whole report: summary, aggregated profile, and the module tree when detailed."""
    mp, topology = parts.mesh.model_parallel_size, parts.mesh.topology
    flops, params = prof.get_total_flops(), prof.get_total_params()
    fwd = prof.get_total_duration()
    lines = [
        "",
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        f"Profile Summary at step {prof.cfg.profile_step}:",
        _NOTATIONS,
        _row("world size: ", topology.world_size),
        _row("data parallel size: ", topology.dp),
        _row("model parallel size: ", mp),
        _row("batch size per GPU: ", parts.batch.micro_batch_size),
        _row("params per GPU: ", number(params).strip()),
        _row("params of model = params per GPU * mp_size: ", number(params * mp).strip()),
        _row("fwd MACs per GPU: ", number(prof.get_total_macs(), "MACs")),
        _row("fwd flops per GPU: ", number(flops)),
        _row("fwd flops of model = fwd flops per GPU * mp_size: ", number(flops * mp)),
        _row("fwd latency: ", number(fwd, "s")),
        _row(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
            number(flops / fwd if fwd else 0, "FLOPS"),
        ),
        *_timings(prof, parts, clock, fwd),
        "",
        "----------------------------- Aggregated Profile per GPU -----------------------------",
        *prof.aggregated(),
    ]
    if prof.cfg.detailed:
        lines += [
            "",
            "------------------------------ Detailed Profile per GPU ------------------------------",
            "Each module profile is listed after its name in the following order: ",
            "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
            "percentage of total fwd latency, fwd FLOPS",
            "",
            "Note: FLOPs are torch.utils.flop_counter's: matrix products, convolutions and "
            "attention; elementwise operations are not counted.",
            "",
            prof.detailed(),
        ]
    return "\n".join([*lines, _RULE])
