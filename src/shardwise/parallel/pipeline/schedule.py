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

Every list ends with REDUCE_GRADS (finish the data-parallel gradient reduction started in the
last backward), REDUCE_TIED (sum tied weights' gradients over the stages that hold them) and
OPTIMIZER_STEP. Communication is asymmetric on purpose: sends are non-blocking (the runtime
posts them and moves on), receives block. ``simulate`` checks, without processes, that under
these semantics every receive finds its send (no deadlock) and that the k-th send on a link
is the k-th receive at the other end (messages pair up in order).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Op(enum.Enum):
    LOAD = "load"  # pull micro-batch i from the data iterator (first stage: inputs; last: labels)
    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    REDUCE_GRADS = "reduce_grads"
    REDUCE_TIED = "reduce_tied"
    OPTIMIZER_STEP = "optimizer_step"


_SHORT = {
    Op.LOAD: "L",
    Op.RECV_ACT: "rA",
    Op.FORWARD: "F",
    Op.SEND_ACT: "sA",
    Op.RECV_GRAD: "rG",
    Op.BACKWARD: "B",
    Op.SEND_GRAD: "sG",
    Op.REDUCE_GRADS: "RG",
    Op.REDUCE_TIED: "RT",
    Op.OPTIMIZER_STEP: "S",
}


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's program: ``op`` on micro-batch ``mb`` of model chunk ``chunk``."""

    op: Op
    mb: int | None = None
    chunk: int = 0

    def __repr__(self) -> str:
        if self.mb is None:
            return _SHORT[self.op]
        return f"{_SHORT[self.op]}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(ValueError):
    """A schedule that cannot run: bad arguments, or a deadlock / mismatch found by simulate."""


SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _check(stages: int, stage_id: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"stages={stages} and micro_batches={micro_batches} must be >= 1")
    if not 0 <= stage_id < stages:
        raise ScheduleError(f"stage_id={stage_id} outside 0..{stages - 1}")


def _forward(stages: int, s: int, i: int, chunk: int = 0, chunks: int = 1) -> list[Instruction]:
    """Forward of micro-batch i on (stage s, chunk): load or receive, run, send."""
    first = s == 0 and chunk == 0
    last = s == stages - 1 and chunk == chunks - 1
    out = []
    if first or last:
        out.append(Instruction(Op.LOAD, i, chunk))
    if not first:
        out.append(Instruction(Op.RECV_ACT, i, chunk))
    out.append(Instruction(Op.FORWARD, i, chunk))
    if not last:
        out.append(Instruction(Op.SEND_ACT, i, chunk))
    return out


def _backward(stages: int, s: int, i: int, chunk: int = 0, chunks: int = 1) -> list[Instruction]:
    first = s == 0 and chunk == 0
    last = s == stages - 1 and chunk == chunks - 1
    out = [] if last else [Instruction(Op.RECV_GRAD, i, chunk)]
    out.append(Instruction(Op.BACKWARD, i, chunk))
    if not first:
        out.append(Instruction(Op.SEND_GRAD, i, chunk))
    return out


_TAIL = [Instruction(Op.REDUCE_GRADS), Instruction(Op.REDUCE_TIED), Instruction(Op.OPTIMIZER_STEP)]


def gpipe(stages: int, stage_id: int, micro_batches: int) -> list[Instruction]:
    """All forwards, then all backwards (GPipe, arXiv 1811.06965)."""
    _check(stages, stage_id, micro_batches)
    prog = [x for i in range(micro_batches) for x in _forward(stages, stage_id, i)]
    prog += [x for i in range(micro_batches) for x in _backward(stages, stage_id, i)]
    return prog + _TAIL


def one_f_one_b(stages: int, stage_id: int, micro_batches: int) -> list[Instruction]:
    """PipeDream-Flush: warm-up forwards, one-forward-one-backward, cool-down backwards."""
    _check(stages, stage_id, micro_batches)
    warmup = min(stages - stage_id - 1, micro_batches)
    prog = [x for i in range(warmup) for x in _forward(stages, stage_id, i)]
    for k in range(micro_batches - warmup):
        prog += _forward(stages, stage_id, warmup + k)
        prog += _backward(stages, stage_id, k)
    for k in range(micro_batches - warmup, micro_batches):
        prog += _backward(stages, stage_id, k)
    return prog + _TAIL


def interleaved(stages: int, stage_id: int, micro_batches: int, chunks: int) -> list[Instruction]:
    """Interleaved 1F1B over ``chunks`` model chunks per stage (Megatron-LM's order).

    Forward k (k = 0 .. m*v-1) runs chunk (k // p) % v on micro-batch (k // (p v)) p + k % p:
    micro-batches go through in groups of p, one chunk after the other; backward k visits the
    chunks in reverse. Stage s warms up with 2(p-s-1) + (v-1)p forwards."""
    _check(stages, stage_id, micro_batches)
    if chunks < 1:
        raise ScheduleError(f"chunks={chunks} must be >= 1")
    if chunks > 1 and micro_batches % stages:
        raise ScheduleError(
            f"interleaved schedule: micro_batches={micro_batches} (gradient_accumulation_steps) "
            f"must be a multiple of stages={stages} (pipeline.stages)"
        )
    total = micro_batches * chunks
    group = stages * chunks

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // stages) % chunks
        return (k // group) * stages + k % stages, chunks - 1 - chunk if backward else chunk

    def fwd(k: int) -> list[Instruction]:
        mb, c = unit(k, False)
        return _forward(stages, stage_id, mb, c, chunks)

    def bwd(k: int) -> list[Instruction]:
        mb, c = unit(k, True)
        return _backward(stages, stage_id, mb, c, chunks)

    warmup = min(total, 2 * (stages - stage_id - 1) + (chunks - 1) * stages)
    if chunks == 1:
        warmup = min(total, stages - stage_id - 1)
    prog = [x for k in range(warmup) for x in fwd(k)]
    for k in range(total - warmup):
        prog += fwd(warmup + k) + bwd(k)
    for k in range(total - warmup, total):
        prog += bwd(k)
    return prog + _TAIL


def inference(stages: int, stage_id: int, micro_batches: int, chunks: int = 1) -> list[Instruction]:
    """Forward only (eval_batch): every micro-batch through the pipeline, nothing kept. With
    chunks, the forwards of the interleaved schedule in its order (dropping its receives of
    gradients only removes waits: it cannot deadlock where the schedule does not)."""
    _check(stages, stage_id, micro_batches)
    if chunks > 1:
        keep = (Op.LOAD, Op.RECV_ACT, Op.FORWARD, Op.SEND_ACT)
        full = interleaved(stages, stage_id, micro_batches, chunks)
        return [ins for ins in full if ins.op in keep]
    return [x for i in range(micro_batches) for x in _forward(stages, stage_id, i)]


def make_schedule(
    name: str, stages: int, stage_id: int, micro_batches: int, chunks: int = 1
) -> list[Instruction]:
    """The program of ``stage_id`` under schedule ``name`` ("gpipe", "1f1b", "interleaved")."""
    builders: dict[str, Callable[[], list[Instruction]]] = {
        "gpipe": lambda: gpipe(stages, stage_id, micro_batches),
        "1f1b": lambda: one_f_one_b(stages, stage_id, micro_batches),
        "interleaved": lambda: interleaved(stages, stage_id, micro_batches, chunks),
    }
    if name not in builders:
        raise ScheduleError(f'pipeline.schedule: expected one of {SCHEDULES}, got "{name}"')
    return builders[name]()


def peak_in_flight(program: list[Instruction]) -> int:
    """The most micro-batches whose forward ran and whose backward has not: how many
    micro-batches' activations the stage stores at once."""
    live, peak = set(), 0
    for ins in program:
        if ins.op is Op.FORWARD:
            live.add((ins.mb, ins.chunk))
            peak = max(peak, len(live))
        elif ins.op is Op.BACKWARD:
            live.discard((ins.mb, ins.chunk))
    return peak


def _destination(stages: int, chunks: int, s: int, ins: Instruction) -> tuple[int, int]:
    """(stage, chunk) at the other end of a send or receive on (stage s, ins.chunk)."""
    virtual = ins.chunk * stages + s
    step = 1 if ins.op in (Op.SEND_ACT, Op.RECV_GRAD) else -1
    other = virtual + step
    if not 0 <= other < stages * chunks:
        raise ScheduleError(f"stage {s}: {ins!r} has no peer (virtual stage {other})")
    return other % stages, other // stages


def simulate(
    programs: list[list[Instruction]],
    chunks: int = 1,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
) -> float:
    """Run every stage's program against the others, with non-blocking sends and blocking
    receives, and return the time the last stage finishes, with a chunk's forward taking
    ``t_forward / chunks`` and its backward ``t_backward / chunks`` (messages are free).

    Raises ScheduleError on a deadlock (naming the stuck instructions) or on a receive that
    gets another micro-batch than it expects (sends and receives out of order)."""
    stages = len(programs)
    links: dict[tuple, list[tuple[int, int, float]]] = {}  # (kind, src, dst, dst chunk) -> queue
    cost = {Op.FORWARD: t_forward / chunks, Op.BACKWARD: t_backward / chunks}
    pc, clock = [0] * stages, [0.0] * stages
    while any(pc[s] < len(programs[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while pc[s] < len(programs[s]):
                ins = programs[s][pc[s]]
                if ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    dst, dst_chunk = _destination(stages, chunks, s, ins)
                    queue = links.setdefault((ins.op, s, dst, dst_chunk), [])
                    queue.append((ins.mb, ins.chunk, clock[s]))
                elif ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    if not _receive(links, stages, chunks, s, ins, clock):
                        break
                clock[s] += cost.get(ins.op, 0.0)
                pc[s] += 1
                moved = True
        if not moved:
            stuck = {s: programs[s][pc[s]] for s in range(stages) if pc[s] < len(programs[s])}
            raise ScheduleError(f"deadlock: stages wait forever at {stuck}")
    left = {k: v for k, v in links.items() if v}
    if left:
        raise ScheduleError(f"messages sent but never received: {left}")
    return max(clock)


def _receive(
    links: dict, stages: int, chunks: int, s: int, ins: Instruction, clock: list[float]
) -> bool:
    """Take the message ``ins`` waits for, if it was sent; False when the stage must wait."""
    src, src_chunk = _destination(stages, chunks, s, ins)
    kind = Op.SEND_ACT if ins.op is Op.RECV_ACT else Op.SEND_GRAD
    queue = links.get((kind, src, s, ins.chunk), [])
    if not queue:
        return False
    mb, chunk, sent_at = queue.pop(0)
    if (mb, chunk) != (ins.mb, src_chunk):
        raise ScheduleError(
            f"stage {s} {ins!r} received micro-batch {mb} (chunk {chunk}) from stage {src}: "
            "sends and receives are not in the same order"
        )
    clock[s] = max(clock[s], sent_at)
    return True
