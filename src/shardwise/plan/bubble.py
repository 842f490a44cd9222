"""A schedule's pipeline bubble and activation hold, from the library's own schedules.

The bubble of schedule ``name`` with p stages and m micro-batches is what the library's
simulator (parallel/pipeline/simulate.py) finds when it runs the instruction lists the runtime
executes, with a micro-batch's time split into the forward F, the backward B and its weight
part W (normalised: F + B = 1, so the result is in micro-batch times of the stage):

    1F1B, GPipe  (p - 1)                       (PTD-P: (p-1)/m of the ideal time)
    ZB-H1        (p - 1)(F + B - 2W), W <= F   (DeepSeek's ZB1P row)
    ZBV, DualPipeV  what their V order leaves  (at most ZB-H1's; see test_pipe_zb_schedule)

F, B, W come from a stage's FLOPs: F the forward's, B twice that plus any recompute, W the
forward's again (a linear's dW = dY^T X costs what its forward X W^T costs; attention's
products without weights belong to B, so this overstates W a little on attention-heavy
layers).
"""

from __future__ import annotations

import functools

from shardwise.parallel.pipeline.instructions import Op, unpair
from shardwise.parallel.pipeline.schedule import (
    V_SCHEDULES,
    make_schedule,
    peak_held,
    placement_of,
    simulate,
)


def chunks_of(name: str) -> int:
    """Model chunks per stage: two in a V, two for the interleaved schedule (planned so)."""
    return 2 if name in (*V_SCHEDULES, "interleaved") else 1


@functools.lru_cache(maxsize=4096)
def bubble_units(name: str, stages: int, micro_batches: int, f: float, w: float) -> float:
    """Idle time of the step in micro-batch times (F = ``f``, B = 1 - f, W = ``w``)."""
    if stages == 1:
        return 0.0
    chunks = chunks_of(name)
    progs = [run_order(name, stages, s, micro_batches, chunks) for s in range(stages)]
    took = simulate(progs, chunks, f, 1.0 - f, w, placement_of(name))
    return took - micro_batches


def run_order(name: str, stages: int, stage: int, micro_batches: int, chunks: int) -> list:
    """The program as the runtime times it: an F&B step (dualpipev) computes its forward then
    its backward on one stream and sends the forward's output in between, which is the timing
    of the pair run in turn (instructions.unpair); messages cost nothing here either way."""
    program = make_schedule(name, stages, stage, micro_batches, chunks)
    return unpair(program, stages, stage, chunks, placement_of(name))


def shares(flops: float, recompute_flops: float) -> tuple[float, float]:
    """(F, W) as shares of a micro-batch's F + B (module docstring), rounded for the cache."""
    total = 3 * flops + recompute_flops
    if total <= 0:
        return 1 / 3, 1 / 3
    return round(flops / total, 3), round(flops / total, 3)


@functools.lru_cache(maxsize=4096)
def held(name: str, stages: int, stage: int, micro_batches: int) -> float:
    """Stage-micro-batches whose activations (then, split, each linear's input and output
    gradient) stage ``stage`` keeps at once: from a forward to the end of its backward
    (schedule.peak_held), in whole-stage units (a V's chunk is half a stage)."""
    chunks = chunks_of(name)
    program = make_schedule(name, stages, stage, micro_batches, chunks)
    return peak_held(program) / chunks


@functools.lru_cache(maxsize=4096)
def split_share(name: str, stages: int, micro_batches: int) -> float:
    """The share of a stage's backwards that run as B and W (split_linear.py: its linears
    routed and their weight work deferred), over the library's programs of every stage; 0
    for schedules that never split (1F1B, GPipe, interleaved)."""
    if stages == 1:
        return 0.0
    chunks = chunks_of(name)
    split = whole = 0
    for s in range(stages):
        for ins in make_schedule(name, stages, s, micro_batches, chunks):
            split += ins.op is Op.BACKWARD_INPUT
            whole += ins.op in (Op.BACKWARD, Op.FORWARD_BACKWARD)
    return split / (split + whole) if split + whole else 0.0
