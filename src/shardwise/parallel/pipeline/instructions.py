"""The vocabulary of pipeline schedules: instructions, and where each model chunk runs.

Notation: p stages, v chunks per stage, the model cut into p v **virtual stages** w = 0 ..
pv - 1 that a micro-batch visits in order. Two placements of the virtual stages on the stages:

    loop  virtual stage w on stage w % p, chunk w // p (Megatron's interleaving: every chunk
          goes 0 -> p-1; the last virtual stage is on stage p-1)
    v     v = 2: chunk 0 is virtual stage s, chunk 1 is virtual stage 2p-1-s, so a micro-batch
          goes down the stages and back up (stage 0 holds the first and the last chunk, stage
          p-1 hands its chunk 0's output to its own chunk 1 without a message)

A backward is either one BACKWARD (the input gradient and the weight gradient together) or,
for the zero-bubble schedules, BACKWARD_INPUT (B: dX, which the previous virtual stage waits
for) and later BACKWARD_WEIGHT (W: dW, which nothing waits for until the step).

FORWARD_BACKWARD (DualPipe's F&B, torch's OVERLAP_F_B) is one step made of the forward of
(mb, chunk) and the full backward of another unit, ``pair`` = (mb, chunk): its messages are its
own (``overlap_messages``: the activation the forward needs, the gradient the backward needs,
and what each sends on), so that each one's communication runs during the other's compute.
``units`` splits it into its FORWARD and BACKWARD; ``unpair`` writes a program without it, the
same work one unit after the other with the messages of each around it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Op(enum.Enum):
    LOAD = "load"  # pull micro-batch i from the data iterator (first stage: inputs; last: labels)
    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"  # input and weight gradients at once
    BACKWARD_INPUT = "backward_input"  # B: the input gradient (weight gradients deferred)
    BACKWARD_WEIGHT = "backward_weight"  # W: the deferred weight gradients
    SEND_GRAD = "send_grad"
    FORWARD_BACKWARD = "forward_backward"  # F&B: a forward and another unit's full backward
    REDUCE_GRADS = "reduce_grads"
    REDUCE_TIED = "reduce_tied"
    OPTIMIZER_STEP = "optimizer_step"


GRADIENT_OPS = (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)  # they write .grad

_SHORT = {
    Op.LOAD: "L",
    Op.RECV_ACT: "rA",
    Op.FORWARD: "F",
    Op.SEND_ACT: "sA",
    Op.RECV_GRAD: "rG",
    Op.BACKWARD: "B",
    Op.BACKWARD_INPUT: "I",
    Op.BACKWARD_WEIGHT: "W",
    Op.SEND_GRAD: "sG",
    Op.FORWARD_BACKWARD: "FB",
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
    pair: tuple[int, int] | None = None  # FORWARD_BACKWARD: the (mb, chunk) it backpropagates

    def __repr__(self) -> str:
        if self.mb is None:
            return _SHORT[self.op]
        if self.op is Op.FORWARD_BACKWARD:
            return "&".join(repr(u) for u in units(self))
        return f"{_SHORT[self.op]}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def units(ins: Instruction) -> list[Instruction]:
    """The compute of ``ins``: a FORWARD_BACKWARD's FORWARD and BACKWARD, else ``ins`` itself."""
    if ins.op is not Op.FORWARD_BACKWARD:
        return [ins]
    return [Instruction(Op.FORWARD, ins.mb, ins.chunk), Instruction(Op.BACKWARD, *ins.pair)]


class ScheduleError(ValueError):
    """A schedule that cannot run: bad arguments, or a deadlock / mismatch found by simulate."""


PLACEMENTS = ("loop", "v")


def virtual_stage(stages: int, stage: int, chunk: int, placement: str = "loop") -> int:
    """The virtual stage that ``chunk`` of ``stage`` runs (module docstring)."""
    if placement == "v" and chunk == 1:
        return 2 * stages - 1 - stage
    return chunk * stages + stage


def stage_and_chunk(stages: int, virtual: int, placement: str = "loop") -> tuple[int, int]:
    """The (stage, chunk) that runs virtual stage ``virtual``."""
    if placement == "v" and virtual >= stages:
        return 2 * stages - 1 - virtual, 1
    return virtual % stages, virtual // stages


def check_args(stages: int, stage_id: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"stages={stages} and micro_batches={micro_batches} must be >= 1")
    if not 0 <= stage_id < stages:
        raise ScheduleError(f"stage_id={stage_id} outside 0..{stages - 1}")


def _ends(stages: int, s: int, chunk: int, chunks: int, placement: str) -> tuple[bool, bool]:
    w = virtual_stage(stages, s, chunk, placement)
    return w == 0, w == stages * chunks - 1


def forward(
    stages: int, s: int, i: int, chunk: int = 0, chunks: int = 1, placement: str = "loop"
) -> list[Instruction]:
    """Forward of micro-batch i on (stage s, chunk): load or receive, run, send."""
    first, last = _ends(stages, s, chunk, chunks, placement)
    out = []
    # One batch per micro-batch per rank: in the V placement stage 0 holds the first and the
    # last chunk, and chunk 0's LOAD reads the labels too.
    if first or (last and placement != "v"):
        out.append(Instruction(Op.LOAD, i, chunk))
    if not first:
        out.append(Instruction(Op.RECV_ACT, i, chunk))
    out.append(Instruction(Op.FORWARD, i, chunk))
    if not last:
        out.append(Instruction(Op.SEND_ACT, i, chunk))
    return out


def backward(
    stages: int,
    s: int,
    i: int,
    chunk: int = 0,
    chunks: int = 1,
    placement: str = "loop",
    op: Op = Op.BACKWARD,
) -> list[Instruction]:
    """Backward (``op``: BACKWARD, or BACKWARD_INPUT) of micro-batch i on (stage s, chunk):
    receive the output gradient, run, send the input gradient."""
    first, last = _ends(stages, s, chunk, chunks, placement)
    out = [] if last else [Instruction(Op.RECV_GRAD, i, chunk)]
    out.append(Instruction(op, i, chunk))
    if not first:
        out.append(Instruction(Op.SEND_GRAD, i, chunk))
    return out


def overlap_messages(
    stages: int, s: int, ins: Instruction, chunks: int, placement: str
) -> tuple[list[Instruction], list[Instruction]]:
    """(receives, sends) of a FORWARD_BACKWARD on stage s: the forward's activation in and out,
    the backward's gradient in and out, each where ``forward`` / ``backward`` would put it."""
    f, b = units(ins)
    first_f, last_f = _ends(stages, s, f.chunk, chunks, placement)
    first_b, last_b = _ends(stages, s, b.chunk, chunks, placement)
    recvs = [Instruction(Op.RECV_ACT, f.mb, f.chunk)] if not first_f else []
    recvs += [Instruction(Op.RECV_GRAD, b.mb, b.chunk)] if not last_b else []
    sends = [Instruction(Op.SEND_ACT, f.mb, f.chunk)] if not last_f else []
    sends += [Instruction(Op.SEND_GRAD, b.mb, b.chunk)] if not first_b else []
    return recvs, sends


def unpair(
    program: list[Instruction], stages: int, s: int, chunks: int, placement: str
) -> list[Instruction]:
    """``program`` with every FORWARD_BACKWARD run one unit after the other: receive, forward,
    send; receive, backward, send (the non-overlapped order; the same computations)."""
    out: list[Instruction] = []
    for ins in program:
        if ins.op is not Op.FORWARD_BACKWARD:
            out.append(ins)
            continue
        (f, b), (recvs, sends) = units(ins), overlap_messages(stages, s, ins, chunks, placement)
        for unit, kinds in ((f, (Op.RECV_ACT, Op.SEND_ACT)), (b, (Op.RECV_GRAD, Op.SEND_GRAD))):
            out += [r for r in recvs if r.op is kinds[0]] + [unit]
            out += [x for x in sends if x.op is kinds[1]]
    return out


TAIL = [Instruction(Op.REDUCE_GRADS), Instruction(Op.REDUCE_TIED), Instruction(Op.OPTIMIZER_STEP)]
