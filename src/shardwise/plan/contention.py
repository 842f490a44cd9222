"""A pipeline's step on ranks that share cores: the schedule run in time, each stage's work
done at the rate the busy ranks of its node leave it.

With a core per rank a stage's clock is its own (parallel/pipeline/simulate.py). With fewer
cores than ranks (a CPU machine), ranks take turns, and how fast a stage computes depends on
which other stages compute at the same moment: a stage waiting for a message leaves its cores
to the others. So the library's instruction lists (bubble.run_order) run here against a
common clock. Each compute instruction is work (seconds on a core of its own) followed by a
wait (its share of the on-path communication: a core is not needed to wait). A node's C cores
serve its busy ranks in equal turns (the kernel's scheduler): with k stages of the node in
their work, r ranks each, every one advances at

    rate = min(1, C / (k r))

so a GPipe or 1F1B step of one micro-batch on 4 ranks and 2 cores (tp2 pp2: one stage busy at
a time) runs at full speed, and a zero-bubble schedule on saturated cores saves nothing: the
idle time 1F1B leaves is lent to the other stage's work, which ZB-H1 would only move.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.parallel.pipeline.instructions import Op
from shardwise.parallel.pipeline.schedule import ScheduleError, placement_of
from shardwise.parallel.pipeline.simulate import Links, messages
from shardwise.plan.bubble import chunks_of, run_order

EPS = 1e-12


@dataclass(frozen=True)
class StageCost:
    """One stage's micro-batch in seconds on a core of its own: forward, backward (input and
    weight gradient), the weight part W of it, and the on-path waits of each (shares of
    ``wait`` in proportion to the work)."""

    forward: float
    backward: float
    weight: float
    wait: float
    hop: float = 0.0  # seconds a message this stage sends takes to be there

    def of(self, op: Op, chunks: int) -> tuple[float, float]:
        """(work, wait) of one instruction on one of ``chunks`` model chunks."""
        work = {
            Op.FORWARD: self.forward,
            Op.BACKWARD: self.backward,
            Op.BACKWARD_INPUT: self.backward - self.weight,
            Op.BACKWARD_WEIGHT: self.weight,
            Op.FORWARD_BACKWARD: self.forward + self.backward,
        }.get(op, 0.0)
        whole = self.forward + self.backward
        return work / chunks, (self.wait * work / whole / chunks if whole > 0 else 0.0)


@dataclass
class Run:
    """The simulated step: each stage's finish, time computing (shared), time waiting."""

    finish: list[float]
    busy: list[float]
    waited: list[float]

    @property
    def makespan(self) -> float:
        return max(self.finish)


@dataclass
class Doing:
    """A stage's instruction under way: work left, then the wait (until ``until``)."""

    ins: object
    work: float
    wait: float
    start: float
    until: float = -1.0  # set when the work is done


def node_of(stages: int, ranks: int, procs_per_node: int) -> list[int]:
    """The node of each stage (pipeline outermost: a stage's ``ranks`` are consecutive; a
    stage wider than a node is a node of its own)."""
    per_node = max(1, procs_per_node // max(ranks, 1))
    return [s // per_node for s in range(stages)]


def contended(
    name: str,
    micro_batches: int,
    costs: list[StageCost],
    ranks: int,
    cores: int,
    procs_per_node: int,
    record: list | None = None,
) -> Run:
    """Schedule ``name`` of ``len(costs)`` stages and ``micro_batches``, each stage ``ranks``
    ranks (dp x cp x tp), on nodes of ``cores`` cores (0: a device each; module docstring).
    ``record`` receives (stage, start, work's end, end, instruction) per compute instruction
    (the wait between the work's end and the end)."""
    stages, chunks, placement = len(costs), chunks_of(name), placement_of(name)
    programs = [run_order(name, stages, s, micro_batches, chunks) for s in range(stages)]
    sim = _Sim(programs, costs, Links(stages, chunks, placement), chunks, placement)
    node = node_of(stages, ranks, procs_per_node)
    run = Run([0.0] * stages, [0.0] * stages, [0.0] * stages)
    while True:
        sim.start_ready()
        arriving = sim.links.next_after(sim.now)
        working = [s for s, d in enumerate(sim.doing) if d is not None and d.until < 0]
        waiting = [s for s, d in enumerate(sim.doing) if d is not None and d.until >= 0]
        if not working and not waiting and arriving is None:
            break
        rate = _rates(working, node, min(ranks, procs_per_node), cores)
        ends = [sim.doing[s].work / rate[s] for s in working]
        ends += [sim.doing[s].until - sim.now for s in waiting]
        ends += [arriving - sim.now] if arriving is not None else []
        dt = max(min(ends), 0.0)
        for s in working:
            d = sim.doing[s]
            d.work -= rate[s] * dt
            run.busy[s] += dt
            if d.work <= EPS:  # the work is done: the wait starts
                d.until = sim.now + dt + d.wait
                run.waited[s] += d.wait
        sim.now += dt
        for s in waiting:
            if sim.doing[s].until <= sim.now + EPS:
                sim.finish(s, run, record)
    sim.check_done()
    return run


def _rates(working: list[int], node: list[int], ranks: int, cores: int) -> dict[int, float]:
    """Each working stage's speed: its node's cores over the node's working ranks."""
    if cores <= 0:
        return dict.fromkeys(working, 1.0)
    per_node: dict[int, int] = {}
    for s in working:
        per_node[node[s]] = per_node.get(node[s], 0) + ranks
    return {s: min(1.0, cores / per_node[node[s]]) for s in working}


@dataclass
class _Sim:
    programs: list[list]
    costs: list[StageCost]
    links: Links
    chunks: int
    placement: str
    now: float = 0.0

    def __post_init__(self) -> None:
        self.pc = [0] * len(self.programs)
        self.doing: list[Doing | None] = [None] * len(self.programs)

    def start_ready(self) -> None:
        """Start every idle stage's next instruction whose messages are there; one without
        work or wait (a lone send or receive) completes at once, and may let another start."""
        moved = True
        while moved:
            moved = False
            for s in range(len(self.programs)):
                while self.doing[s] is None and self.pc[s] < len(self.programs[s]):
                    if not self._begin(s):
                        break
                    moved = True

    def _begin(self, s: int) -> bool:
        """Begin stage ``s``'s next instruction if its messages are there (True if so)."""
        ins = self.programs[s][self.pc[s]]
        recvs, sends = messages(len(self.programs), self.chunks, s, ins, self.placement)
        if not all(self.links.arrived(s, r, self.now + EPS) for r in recvs):
            return False
        for r in recvs:
            self.links.take(s, r)  # sent earlier: the common clock is past it
        work, wait = self.costs[s].of(ins.op, self.chunks)
        if work <= 0 and wait <= 0:
            for x in sends:
                self.links.post(s, x, self.now + self.costs[s].hop)
            self.pc[s] += 1
        else:
            self.doing[s] = Doing(ins, work, wait, self.now)
        return True

    def finish(self, s: int, run: Run, record: list | None) -> None:
        """Stage ``s`` ends its instruction now: its sends leave, it moves on."""
        d = self.doing[s]
        _, sends = messages(len(self.programs), self.chunks, s, d.ins, self.placement)
        for x in sends:
            self.links.post(s, x, self.now + self.costs[s].hop)
        run.finish[s] = self.now
        if record is not None:
            record.append((s, d.start, d.until - d.wait, self.now, d.ins))
        self.pc[s] += 1
        self.doing[s] = None

    def check_done(self) -> None:
        stuck = {s: p[self.pc[s]] for s, p in enumerate(self.programs) if self.pc[s] < len(p)}
        if stuck:
            raise ScheduleError(f"deadlock: stages wait forever at {stuck}")
        self.links.check_empty()
