"""Zero-bubble pipeline schedules as data: the backward split into B and W.

Notation (DeepSeek's table, DualPipe README): p stages, m micro-batches, F the time of a
forward, B of a full backward, W of its weight part, so B - W is the input part (the "B" of
the schedules below, ``Op.BACKWARD_INPUT``). Only the input part is on the critical path: the
previous stage waits for dX, nobody waits for dW before the optimizer step. The zero-bubble
schedules move W into the time a stage would otherwise wait.

    1F1B      bubble (p-1)(F+B)
    ZB-H1     bubble (p-1)(F+B-2W)   (Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024;
              "ZB1P" in DeepSeek's table): 1F1B's order and memory, with stage s deferring its
              W's by s micro-batches, so that the last stage's B's, and with them the chain
              back to stage 0, come earlier; the deferred W's fill the cool-down.

``split_backward`` turns a fused program into one that runs B then W at once (the same order
as 1F1B, for testing the split alone); ``fuse_backward`` does the reverse, for a stage whose
layers cannot split (the instructions then say that B does everything).
"""

from __future__ import annotations

from shardwise.parallel.pipeline.instructions import Instruction, Op


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
