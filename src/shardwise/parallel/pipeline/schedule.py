"""Pipeline schedules as data: pure functions from (stages, stage id, micro-batches) to the
ordered list of instructions one stage executes for one global batch.

Notation: p stages, m micro-batches, stage s in 0..p-1. Stage s runs the forward of every
micro-batch i (F_i) and later its backward (B_i); activations go s -> s+1, gradients s+1 -> s.

    GPipe   F_0 .. F_{m-1}, then B_0 .. B_{m-1}: every stage holds m micro-batches'
            activations at the peak.
    1F1B    (PipeDream-Flush) min(p-s-1, m) warm-up forwards, then alternate one forward and
            one backward, then the remaining backwards: at most min(p-s, m) micro-batches in
            flight on stage s. The bubble is the same as GPipe's: (p-1)/m of the ideal time.
    Interleaved 1F1B (Megatron, PTD-P 2.2.2) with v model chunks per stage: stage s holds
            virtual stages s, s+p, ..., s+(v-1)p; the bubble shrinks to (p-1)/(v m) at the cost
            of v times more messages; m must be a multiple of p.
    Zero-bubble schedules (zero_bubble.py) split each backward into B (input gradient) and
            W (weight gradient) and run the W's where 1F1B would wait: ZB-H1 (1F1B's memory), and,
            with two chunks per stage in the V placement, ZB-V and DualPipeV.

Every list ends with REDUCE_GRADS (finish the data-parallel gradient reduction started in the
last backward), REDUCE_TIED (sum tied weights' gradients over the stages that hold them) and
OPTIMIZER_STEP. Communication is asymmetric on purpose: sends are non-blocking (the runtime
posts them and moves on), receives block. ``simulate`` checks, without processes, that under
these semantics every receive finds its send (no deadlock) and that the k-th send on a link
is the k-th receive at the other end (messages pair up in order).
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.parallel.pipeline.instructions import (
    TAIL,
    Instruction,
    Op,
    ScheduleError,
    backward,
    check_args,
    forward,
    units,
    unpair,
)
from shardwise.parallel.pipeline.simulate import simulate
from shardwise.parallel.pipeline.zero_bubble import dualpipev, zb_h1, zbv

__all__ = [
    "SCHEDULES",
    "Instruction",
    "Op",
    "ScheduleError",
    "gpipe",
    "inference",
    "interleaved",
    "make_schedule",
    "one_f_one_b",
    "peak_in_flight",
    "simulate",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per stage in the V placement


def placement_of(name: str) -> str:
    """Where schedule ``name`` puts the chunks (instructions.py): "v" or "loop"."""
    return "v" if name in V_SCHEDULES else "loop"


def gpipe(stages: int, stage_id: int, micro_batches: int) -> list[Instruction]:
    """All forwards, then all backwards (GPipe, arXiv 1811.06965)."""
    check_args(stages, stage_id, micro_batches)
    prog = [x for i in range(micro_batches) for x in forward(stages, stage_id, i)]
    prog += [x for i in range(micro_batches) for x in backward(stages, stage_id, i)]
    return prog + TAIL


def one_f_one_b(stages: int, stage_id: int, micro_batches: int) -> list[Instruction]:
    """PipeDream-Flush: warm-up forwards, one-forward-one-backward, cool-down backwards."""
    check_args(stages, stage_id, micro_batches)
    warmup = min(stages - stage_id - 1, micro_batches)
    prog = [x for i in range(warmup) for x in forward(stages, stage_id, i)]
    for k in range(micro_batches - warmup):
        prog += forward(stages, stage_id, warmup + k)
        prog += backward(stages, stage_id, k)
    for k in range(micro_batches - warmup, micro_batches):
        prog += backward(stages, stage_id, k)
    return prog + TAIL


def interleaved(stages: int, stage_id: int, micro_batches: int, chunks: int) -> list[Instruction]:
    """Interleaved 1F1B over ``chunks`` model chunks per stage (Megatron-LM's order).

    Forward k (k = 0 .. m*v-1) runs chunk (k // p) % v on micro-batch (k // (p v)) p + k % p:
    micro-batches go through in groups of p, one chunk after the other; backward k visits the
    chunks in reverse. Stage s warms up with 2(p-s-1) + (v-1)p forwards."""
    check_args(stages, stage_id, micro_batches)
    if chunks < 1:
        raise ScheduleError(f"chunks={chunks} must be >= 1")
    if chunks > 1 and micro_batches % stages:
        raise ScheduleError(
            f"interleaved schedule: micro_batches={micro_batches} (gradient_accumulation_steps) "
            f"must be a multiple of stages={stages} (pipeline.stages)"
        )
    total = micro_batches * chunks
    group = stages * chunks

    def unit(k: int, back: bool) -> tuple[int, int]:
        chunk = (k // stages) % chunks
        return (k // group) * stages + k % stages, chunks - 1 - chunk if back else chunk

    def fwd(k: int) -> list[Instruction]:
        mb, c = unit(k, False)
        return forward(stages, stage_id, mb, c, chunks)

    def bwd(k: int) -> list[Instruction]:
        mb, c = unit(k, True)
        return backward(stages, stage_id, mb, c, chunks)

    warmup = min(total, 2 * (stages - stage_id - 1) + (chunks - 1) * stages)
    if chunks == 1:
        warmup = min(total, stages - stage_id - 1)
    prog = [x for k in range(warmup) for x in fwd(k)]
    for k in range(total - warmup):
        prog += fwd(warmup + k) + bwd(k)
    for k in range(total - warmup, total):
        prog += bwd(k)
    return prog + TAIL


def inference(
    stages: int, stage_id: int, micro_batches: int, chunks: int = 1, name: str = "interleaved"
) -> list[Instruction]:
    """Forward only (eval_batch): every micro-batch through the pipeline, nothing kept. With
    chunks, the forwards of schedule ``name`` in its order (dropping its receives of
    gradients only removes waits: it cannot deadlock where the schedule does not)."""
    check_args(stages, stage_id, micro_batches)
    if chunks > 1:
        keep = (Op.LOAD, Op.RECV_ACT, Op.FORWARD, Op.SEND_ACT)
        count = micro_batches  # DualPipeV's order needs 2p micro-batches: drop the extra ones
        if name in V_SCHEDULES:
            count = max(micro_batches, 2 * stages)
        else:
            name = "interleaved"
        full = make_schedule(name, stages, stage_id, count, chunks)
        full = unpair(full, stages, stage_id, chunks, placement_of(name))  # F&B: forwards only
        return [ins for ins in full if ins.op in keep and ins.mb < micro_batches]
    return [x for i in range(micro_batches) for x in forward(stages, stage_id, i)]


def make_schedule(
    name: str, stages: int, stage_id: int, micro_batches: int, chunks: int = 1
) -> list[Instruction]:
    """The program of ``stage_id`` under schedule ``name`` (one of ``SCHEDULES``)."""
    builders: dict[str, Callable[[], list[Instruction]]] = {
        "gpipe": lambda: gpipe(stages, stage_id, micro_batches),
        "1f1b": lambda: one_f_one_b(stages, stage_id, micro_batches),
        "interleaved": lambda: interleaved(stages, stage_id, micro_batches, chunks),
        "zb-h1": lambda: zb_h1(stages, stage_id, micro_batches),
        "zbv": lambda: zbv(stages, stage_id, micro_batches),
        "dualpipev": lambda: dualpipev(stages, stage_id, micro_batches),
    }
    if name not in builders:
        raise ScheduleError(f'pipeline.schedule: expected one of {SCHEDULES}, got "{name}"')
    if name in V_SCHEDULES and chunks != 2:
        raise ScheduleError(
            f'pipeline.schedule="{name}" runs two chunks per stage (a V): pipeline.chunks must '
            f"be 2, got {chunks}"
        )
    return builders[name]()


def peak_in_flight(program: list[Instruction]) -> int:
    """The most micro-batches whose forward ran and whose backward has not: how many
    micro-batches' activations the stage stores at once."""
    return _peak_live(program, (Op.BACKWARD, Op.BACKWARD_INPUT))


def peak_held(program: list[Instruction]) -> int:
    """The most (micro-batch, chunk) units between their forward and the end of their
    backward (a full BACKWARD, or the W of a split one): what a zero-bubble stage keeps,
    activations until B and then each linear's input and output gradient until W."""
    return _peak_live(program, (Op.BACKWARD, Op.BACKWARD_WEIGHT))


def _peak_live(program: list[Instruction], ends: tuple[Op, ...]) -> int:
    """The most (micro-batch, chunk) units alive at once: from FORWARD to an op of ``ends``."""
    live, peak = set(), 0
    for ins in (u for x in program for u in units(x)):
        if ins.op is Op.FORWARD:
            live.add((ins.mb, ins.chunk))
            peak = max(peak, len(live))
        elif ins.op in ends:
            live.discard((ins.mb, ins.chunk))
    return peak
