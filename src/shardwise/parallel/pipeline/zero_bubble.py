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
    ZB-V      two chunks per stage in a V (instructions.py; Qi et al., section 6): at most 2p
              half-stage units in flight (1F1B's peak); simulated bubble at most ZB-H1's.
    DualPipeV DeepSeek-V3's DualPipe cut in half, V placed: (PP/2-1)(F&B+B-3W) with PP = 2p
              half-stage chunks and F&B an overlapped forward + backward pair (one
              FORWARD_BACKWARD step: each one's messages travel during the other's compute;
              on one CPU stream the compute itself runs one after the other); m >= 2p.

``split_backward`` turns a fused program into one that runs B then W at once (the same order
as 1F1B, for testing the split alone); ``fuse_backward`` does the reverse, for a stage whose
layers cannot split (the instructions then say that B does everything).
"""

from __future__ import annotations

from shardwise.parallel.pipeline.instructions import (
    TAIL,
    Instruction,
    Op,
    ScheduleError,
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


class _VProgram:
    """One stage's program in the V placement (two chunks), built unit by unit: each call runs
    the next micro-batch of a (kind, chunk), with its messages; units of micro-batches >= m
    (the schedules below are written for at least their minimum m) are left out."""

    def __init__(self, stages: int, stage_id: int, micro_batches: int) -> None:
        check_args(stages, stage_id, micro_batches)
        self.p, self.s, self.m = stages, stage_id, micro_batches
        self.count: dict[tuple[Op, int], int] = {}
        self.prog: list[Instruction] = []
        self.waiting: list[tuple[int, int]] = []  # (micro-batch, chunk) whose W is due

    def _next(self, op: Op, chunk: int) -> int:
        i = self.count.get((op, chunk), 0)
        self.count[(op, chunk)] = i + 1
        return i

    def f(self, chunk: int) -> None:
        i = self._next(Op.FORWARD, chunk)
        if i < self.m:
            self.prog += forward(self.p, self.s, i, chunk, 2, "v")

    def b(self, chunk: int, split: bool = True) -> None:
        """The next backward of ``chunk``: B (its W queued) or, not ``split``, the full one."""
        i = self._next(Op.BACKWARD_INPUT, chunk)
        if i < self.m:
            op = Op.BACKWARD_INPUT if split else Op.BACKWARD
            self.prog += backward(self.p, self.s, i, chunk, 2, "v", op)
            if split:
                self.waiting.append((i, chunk))

    def fb(self, f_chunk: int, b_chunk: int) -> None:
        """The next forward of ``f_chunk`` and full backward of ``b_chunk`` as one F&B step
        (FORWARD_BACKWARD), or the one of them left when the other is past m."""
        i, j = (
            self.count.get((Op.FORWARD, f_chunk), 0),
            self.count.get((Op.BACKWARD_INPUT, b_chunk), 0),
        )
        if i >= self.m or j >= self.m:
            self.f(f_chunk)
            self.b(b_chunk, split=False)
            return
        self._next(Op.FORWARD, f_chunk), self._next(Op.BACKWARD_INPUT, b_chunk)
        loads = forward(self.p, self.s, i, f_chunk, 2, "v")
        self.prog += [x for x in loads if x.op is Op.LOAD]
        self.prog.append(Instruction(Op.FORWARD_BACKWARD, i, f_chunk, pair=(j, b_chunk)))

    def w(self, chunk: int | None = None) -> None:
        """The oldest W due (of ``chunk`` when given), if any."""
        due = [k for k, (_, c) in enumerate(self.waiting) if chunk in (None, c)]
        if due:
            i, c = self.waiting.pop(due[0])
            self.prog.append(Instruction(Op.BACKWARD_WEIGHT, i, c))

    def done(self) -> list[Instruction]:
        while self.waiting:
            self.w()
        return self.prog + TAIL


def zbv(stages: int, stage_id: int, micro_batches: int) -> list[Instruction]:
    """ZB-V (Qi et al., section 6): two chunks in the V placement. Warm-up: 2(p-s)-1 forwards
    of chunk 0, s pairs (F1, F0), p-s triples (F1, B1, W1); steady: (F0, B0, W0, F1, B1, W1);
    cool-down: s pairs (B0, B1), p-s pairs (B0, W0), then the W's due, chunk 1's first. For
    m >= 2p-1 micro-batches; with fewer, the missing micro-batches' units are left out."""
    v = _VProgram(stages, stage_id, micro_batches)
    p, s, n = stages, stage_id, max(2 * stages - 1, micro_batches)
    for _ in range(2 * (p - s) - 1):
        v.f(0)
    for _ in range(s):
        v.f(1)
        v.f(0)
    for _ in range(p - s):
        v.f(1), v.b(1), v.w(1)
    while v.count[(Op.FORWARD, 1)] < v.count[(Op.FORWARD, 0)] or v.count[(Op.FORWARD, 0)] < n:
        if v.count[(Op.FORWARD, 0)] < n:
            v.f(0)
        v.b(0), v.w(0), v.f(1), v.b(1), v.w(1)
    for _ in range(s):
        v.b(0), v.b(1)
    for _ in range(p - s):
        v.b(0), v.w(0)
    while any(c == 1 for _, c in v.waiting):  # chunk 1's W's first, then chunk 0's
        v.w(1)
    return v.done()


def dualpipev(stages: int, stage_id: int, micro_batches: int) -> list[Instruction]:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half, in the V placement): the steady state
    pairs the forward of one chunk with the full backward of the other in one F&B step
    (F0&B1, F1&B0: FORWARD_BACKWARD, as torch's OVERLAP_F_B); warm-up and cool-down use B/W
    splits to fill the bubbles. Needs m >= 2p micro-batches."""
    p, s, m = stages, stage_id, micro_batches
    if m < 2 * p:
        raise ScheduleError(
            f"dualpipev: micro_batches={m} (gradient_accumulation_steps) must be at least "
            f"2 * stages = {2 * p}"
        )
    v = _VProgram(p, s, m)
    for _ in range(2 * (p - s - 1)):
        v.f(0)
    for _ in range(s + 1):
        v.f(0), v.f(1)
    for _ in range(p - s - 1):
        v.b(1), v.w(), v.f(1)
    for k in range(m - 2 * p + s + 1):
        if k == 0 and s == p - 1:  # the last stage's first pair is not overlapped (torch's)
            v.f(0), v.b(1, split=False)
        else:
            v.fb(0, 1)  # F0 & B1
        v.fb(1, 0)  # F1 & B0
    for _ in range(p - s - 1):
        v.b(1, split=False)
        v.fb(1, 0)
    split = False
    for k in range(s + 1):  # the second half of these backwards splits, for W to fill in
        split = split or (k == (s + 1) // 2 and s % 2 == 1)
        v.b(1, split)
        split = split or (k == (s + 1) // 2 and s % 2 == 0)
        v.b(0, split)
    for _ in range(p - s - 1):
        v.w(), v.b(0, split)
    return v.done()
