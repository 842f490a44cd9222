"""Zero-bubble pipeline schedules as data: the backward split into B and W.

Notation (DeepSeek's table, DualPipe README): p stages, m micro-batches, F the time of a
forward, B of a full backward, W of its weight part, so B - W is the input part (the "B" of
the schedules below, ``Op.BACKWARD_INPUT``). Only the input part is on the critical path: the
previous stage waits for dX, nobody waits for dW before the optimizer step. The zero-bubble
schedules move W into the time a stage would otherwise wait.

    1F1B      bubble (p-1)(F+B)
    ZB-H1     bubble (p-1)(F+B-2W) when W <= F, else (p-1)(B-W): (p-1)(B-W + max(F-W, 0))
              (Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024; "ZB1P" in DeepSeek's
              table). 1F1B's order and activation memory, with stage s running each W s
              micro-batches after its B: the last stage sends its input gradients W earlier
              per micro-batch, so the chain back to stage 0 arrives (p-1)W sooner, and stage
              0, which sends nothing back, fills with its own W's the wait that remains. With
              W > F the chain of input backwards (p-1)(B-W) is what is left.

``split_backward`` turns a fused program into one that runs B then W at once (the same order
as 1F1B, for testing the split alone); ``fuse_backward`` does the reverse, for a stage whose
layers cannot split (the instructions then say that B does everything).
"""

from __future__ import annotations

from shardwise.parallel.pipeline.instructions import (
    TAIL,
    Instruction,
    Op,
    backward,
    check_args,
    forward,
)


def split_backward(program: list[Instruction]) -> list[Instruction]:
    """Every BACKWARD as BACKWARD_INPUT, then (after its SEND_GRAD, if any) BACKWARD_WEIGHT."""
    out: list[Instruction] = []
    pending: Instruction | None = None
    for ins in program:
        if pending is not None and not (ins.op is Op.SEND_GRAD and ins.mb == pending.mb):
            out.append(pending)
            pending = None
        if ins.op is Op.BACKWARD:
            out.append(Instruction(Op.BACKWARD_INPUT, ins.mb, ins.chunk))
            pending = Instruction(Op.BACKWARD_WEIGHT, ins.mb, ins.chunk)
            continue
        out.append(ins)
        if ins.op is Op.SEND_GRAD and pending is not None:
            out.append(pending)
            pending = None
    return out + ([pending] if pending is not None else [])


def fuse_backward(program: list[Instruction]) -> list[Instruction]:
    """Every BACKWARD_INPUT as a full BACKWARD, every BACKWARD_WEIGHT dropped."""
    return [
        Instruction(Op.BACKWARD, ins.mb, ins.chunk) if ins.op is Op.BACKWARD_INPUT else ins
        for ins in program
        if ins.op is not Op.BACKWARD_WEIGHT
    ]


def zb_h1(stages: int, stage_id: int, micro_batches: int) -> list[Instruction]:
    """ZB-H1 on stage s: 1F1B's min(p-s-1, m) warm-up forwards and F/B alternation, each W
    run s micro-batches after its B (the last stage's W's wait longest), the rest at the end."""
    check_args(stages, stage_id, micro_batches)
    p, s, m = stages, stage_id, micro_batches
    warmup = min(p - s - 1, m)
    prog = [x for i in range(warmup) for x in forward(p, s, i)]
    waiting: list[int] = []  # micro-batches whose W is still to run
    for k in range(m):
        if warmup + k < m:
            prog += forward(p, s, warmup + k)
        prog += backward(p, s, k, op=Op.BACKWARD_INPUT)
        waiting.append(k)
        if len(waiting) > s:
            prog.append(Instruction(Op.BACKWARD_WEIGHT, waiting.pop(0)))
    prog += [Instruction(Op.BACKWARD_WEIGHT, k) for k in waiting]
    return prog + TAIL
