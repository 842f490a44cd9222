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
    FORWARD_BACKWARD F&B = t_overlap / v       (t_overlap defaults to t_forward + t_backward)

so a micro-batch costs F + B per chunk whether its backward is split or not, and the bubble of
a schedule is ``simulate(...) - m (t_forward + t_backward)``, the notation of DeepSeek's table
(B the full backward, W its weight part). A FORWARD_BACKWARD (DualPipe's F&B) is one block:
it starts when both its messages are there and sends both results when it ends, what DeepSeek's
table assumes of an overlapped pair (its time F&B is below F + B where the two overlap).
"""

from __future__ import annotations

from shardwise.parallel.pipeline.instructions import (
    Instruction,
    Op,
    ScheduleError,
    overlap_messages,
    stage_and_chunk,
    virtual_stage,
)

RECEIVES, SENDS = (Op.RECV_ACT, Op.RECV_GRAD), (Op.SEND_ACT, Op.SEND_GRAD)


def _costs(
    chunks: int,
    t_forward: float,
    t_backward: float,
    t_weight: float | None,
    t_overlap: float | None,
) -> dict:
    w = t_backward / 2 if t_weight is None else t_weight
    fb = t_forward + t_backward if t_overlap is None else t_overlap
    return {
        Op.FORWARD: t_forward / chunks,
        Op.BACKWARD: t_backward / chunks,
        Op.BACKWARD_INPUT: (t_backward - w) / chunks,
        Op.BACKWARD_WEIGHT: w / chunks,
        Op.FORWARD_BACKWARD: fb / chunks,
    }


def messages(
    stages: int, chunks: int, s: int, ins: Instruction, placement: str
) -> tuple[list[Instruction], list[Instruction]]:
    """(receives before, sends after) the compute of ``ins``."""
    if ins.op is Op.FORWARD_BACKWARD:
        return overlap_messages(stages, s, ins, chunks, placement)
    return ([ins] if ins.op in RECEIVES else []), ([ins] if ins.op in SENDS else [])


def simulate(
    programs: list[list[Instruction]],
    chunks: int = 1,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float | None = None,
    placement: str = "loop",
    t_overlap: float | None = None,
) -> float:
    """The makespan of ``programs`` (one per stage) under the module docstring's semantics and
    costs; ``placement``: where the chunks run (instructions.py).

    Raises ScheduleError on a deadlock (naming the stuck instructions) or on a receive that
    gets another micro-batch than it expects (sends and receives out of order)."""
    finish, _ = timeline(
        programs, chunks, t_forward, t_backward, t_weight, placement, t_overlap=t_overlap
    )
    return max(finish)


def timeline(
    programs: list[list[Instruction]],
    chunks: int = 1,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float | None = None,
    placement: str = "loop",
    record: list | None = None,
    t_overlap: float | None = None,
) -> tuple[list[float], list[float]]:
    """(finish time, busy time) of every stage: its idle time is finish - busy, within the
    makespan max(finish) - busy. ``record``, when given, receives one
    ``(stage, start, end, instruction)`` per compute instruction (a picture of the run)."""
    stages = len(programs)
    links = Links(stages, chunks, placement)
    cost = _costs(chunks, t_forward, t_backward, t_weight, t_overlap)
    pc, clock, busy = [0] * stages, [0.0] * stages, [0.0] * stages
    while any(pc[s] < len(programs[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while pc[s] < len(programs[s]):
                ins = programs[s][pc[s]]
                recvs, sends = messages(stages, chunks, s, ins, placement)
                if not all(links.arrived(s, r) for r in recvs):
                    break
                for r in recvs:
                    clock[s] = max(clock[s], links.take(s, r))
                took = cost.get(ins.op, 0.0)
                if record is not None and took:
                    record.append((s, clock[s], clock[s] + took, ins))
                clock[s] += took
                busy[s] += took
                for x in sends:
                    links.post(s, x, clock[s])
                pc[s] += 1
                moved = True
        if not moved:
            stuck = {s: programs[s][pc[s]] for s in range(stages) if pc[s] < len(programs[s])}
            raise ScheduleError(f"deadlock: stages wait forever at {stuck}")
    links.check_empty()
    return clock, busy


class Links:
    """The messages in flight between stages: each send queued on its link with the time it
    was sent, each receive taking the oldest (the runtime's order: a mismatch is an error)."""

    def __init__(self, stages: int, chunks: int, placement: str) -> None:
        self.stages, self.chunks, self.placement = stages, chunks, placement
        self.queues: dict[tuple, list[tuple[int, int, float]]] = {}  # (kind, src, dst, chunk)

    def post(self, s: int, ins: Instruction, at: float) -> None:
        """Stage ``s`` sends ``ins`` (a SEND_*) at time ``at``."""
        dst, dst_chunk = _peer(self.stages, self.chunks, s, ins, self.placement)
        self.queues.setdefault((ins.op, s, dst, dst_chunk), []).append((ins.mb, ins.chunk, at))

    def _queue(self, s: int, ins: Instruction) -> list:
        src, _ = _peer(self.stages, self.chunks, s, ins, self.placement)
        kind = Op.SEND_ACT if ins.op is Op.RECV_ACT else Op.SEND_GRAD
        return self.queues.get((kind, src, s, ins.chunk), [])

    def arrived(self, s: int, ins: Instruction, by: float = float("inf")) -> bool:
        """Was the message the receive ``ins`` of stage ``s`` waits for sent (there by ``by``)?"""
        queue = self._queue(s, ins)
        return bool(queue) and queue[0][2] <= by

    def next_after(self, now: float) -> float | None:
        """The earliest time after ``now`` a message in flight is there (None: none is)."""
        later = [q[0][2] for q in self.queues.values() if q and q[0][2] > now]
        return min(later, default=None)

    def take(self, s: int, ins: Instruction) -> float:
        """Take the message ``ins`` waits for (``arrived``); the time it was sent."""
        src, src_chunk = _peer(self.stages, self.chunks, s, ins, self.placement)
        mb, chunk, sent_at = self._queue(s, ins).pop(0)
        if (mb, chunk) != (ins.mb, src_chunk):
            raise ScheduleError(
                f"stage {s} {ins!r} received micro-batch {mb} (chunk {chunk}) from stage "
                f"{src}: sends and receives are not in the same order"
            )
        return sent_at

    def check_empty(self) -> None:
        left = {k: v for k, v in self.queues.items() if v}
        if left:
            raise ScheduleError(f"messages sent but never received: {left}")


def _peer(stages: int, chunks: int, s: int, ins: Instruction, placement: str) -> tuple[int, int]:
    """(stage, chunk) at the other end of a send or receive on (stage s, ins.chunk)."""
    virtual = virtual_stage(stages, s, ins.chunk, placement)
    step = 1 if ins.op in (Op.SEND_ACT, Op.RECV_GRAD) else -1
    other = virtual + step
    if not 0 <= other < stages * chunks:
        raise ScheduleError(f"stage {s}: {ins!r} has no peer (virtual stage {other})")
    return stage_and_chunk(stages, other, placement)
