"""Run every stage's instruction list against the others, without processes.

Semantics are the runtime's: sends never block (the message is queued on its link), a receive
waits until its message was sent. Each compute instruction takes a fixed time; messages are
free. The clock of a stage advances by its own work and jumps forward when a receive waits for
a message sent later, so the result is the time the last stage finishes (the makespan).

Costs, per model chunk (a stage's work divided by the v chunks it holds):

    FORWARD          F = t_forward / v
    BACKWARD         B = t_backward / v        (input and weight gradient together)
    BACKWARD_INPUT   B - W
    BACKWARD_WEIGHT  W = t_weight / v          (t_weight defaults to t_backward / 2)

so a micro-batch costs F + B per chunk whether its backward is split or not, and the bubble of
a schedule is ``simulate(...) - m (t_forward + t_backward)``, the notation of DeepSeek's table
(B the full backward, W its weight part).
"""

from __future__ import annotations

from shardwise.parallel.pipeline.instructions import (
    Instruction,
    Op,
    ScheduleError,
    stage_and_chunk,
    virtual_stage,
)


def _costs(chunks: int, t_forward: float, t_backward: float, t_weight: float | None) -> dict:
    w = t_backward / 2 if t_weight is None else t_weight
    return {
        Op.FORWARD: t_forward / chunks,
        Op.BACKWARD: t_backward / chunks,
        Op.BACKWARD_INPUT: (t_backward - w) / chunks,
        Op.BACKWARD_WEIGHT: w / chunks,
    }


def simulate(
    programs: list[list[Instruction]],
    chunks: int = 1,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float | None = None,
    placement: str = "loop",
) -> float:
    """The makespan of ``programs`` (one per stage) under the module docstring's semantics and
    costs; ``placement``: where the chunks run (instructions.py).

    Raises ScheduleError on a deadlock (naming the stuck instructions) or on a receive that
    gets another micro-batch than it expects (sends and receives out of order)."""
    return max(timeline(programs, chunks, t_forward, t_backward, t_weight, placement)[0])


def timeline(
    programs: list[list[Instruction]],
    chunks: int = 1,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float | None = None,
    placement: str = "loop",
    record: list | None = None,
) -> tuple[list[float], list[float]]:
    """(finish time, busy time) of every stage: its idle time is finish - busy, within the
    makespan max(finish) - busy. ``record``, when given, receives one
    ``(stage, start, end, instruction)`` per compute instruction (a picture of the run)."""
    stages = len(programs)
    links: dict[tuple, list[tuple[int, int, float]]] = {}  # (kind, src, dst, dst chunk) -> queue
    cost = _costs(chunks, t_forward, t_backward, t_weight)
    pc, clock, busy = [0] * stages, [0.0] * stages, [0.0] * stages
    while any(pc[s] < len(programs[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while pc[s] < len(programs[s]):
                ins = programs[s][pc[s]]
                if ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    dst, dst_chunk = _peer(stages, chunks, s, ins, placement)
                    queue = links.setdefault((ins.op, s, dst, dst_chunk), [])
                    queue.append((ins.mb, ins.chunk, clock[s]))
                elif ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    if not _receive(links, stages, chunks, s, ins, clock, placement):
                        break
                took = cost.get(ins.op, 0.0)
                if record is not None and took:
                    record.append((s, clock[s], clock[s] + took, ins))
                clock[s] += took
                busy[s] += took
                pc[s] += 1
                moved = True
        if not moved:
            stuck = {s: programs[s][pc[s]] for s in range(stages) if pc[s] < len(programs[s])}
            raise ScheduleError(f"deadlock: stages wait forever at {stuck}")
    left = {k: v for k, v in links.items() if v}
    if left:
        raise ScheduleError(f"messages sent but never received: {left}")
    return clock, busy


def _peer(stages: int, chunks: int, s: int, ins: Instruction, placement: str) -> tuple[int, int]:
    """(stage, chunk) at the other end of a send or receive on (stage s, ins.chunk)."""
    virtual = virtual_stage(stages, s, ins.chunk, placement)
    step = 1 if ins.op in (Op.SEND_ACT, Op.RECV_GRAD) else -1
    other = virtual + step
    if not 0 <= other < stages * chunks:
        raise ScheduleError(f"stage {s}: {ins!r} has no peer (virtual stage {other})")
    return stage_and_chunk(stages, other, placement)


def _receive(
    links: dict,
    stages: int,
    chunks: int,
    s: int,
    ins: Instruction,
    clock: list[float],
    placement: str,
) -> bool:
    """Take the message ``ins`` waits for, if it was sent; False when the stage must wait."""
    src, src_chunk = _peer(stages, chunks, s, ins, placement)
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
