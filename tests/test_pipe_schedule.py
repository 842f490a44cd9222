"""Pipeline schedules are data: the instruction lists checked without processes.

For every schedule, number of stages p and micro-batches m: each micro-batch is loaded (first
and last stage), forwarded and backwarded exactly once per stage, forward before backward; the
programs run against each other (``simulate``: non-blocking sends, blocking receives, the
runtime's semantics) without deadlock and with every receive getting the micro-batch it
expects; the in-flight bound holds (1F1B: min(p - s, m) on stage s; GPipe: m); and the time
the simulation takes is the papers' formula (PTD-P, arXiv 2104.04473, 2.2):
(m + p - 1)(t_f + t_b) for GPipe and 1F1B, m(t_f + t_b) + (p - 1)(t_f + t_b)/v interleaved.
"""

import itertools

import pytest

from shardwise.parallel.pipeline.schedule import (
    Instruction,
    Op,
    ScheduleError,
    gpipe,
    inference,
    interleaved,
    make_schedule,
    one_f_one_b,
    peak_in_flight,
    simulate,
)

GRID = list(itertools.product(["gpipe", "1f1b"], [1, 2, 3, 4], [1, 2, 3, 8]))
TF, TB = 1.0, 2.0  # a backward costs about two forwards


def _programs(name, p, m, v=1):
    if name == "interleaved":
        return [interleaved(p, s, m, v) for s in range(p)]
    return [make_schedule(name, p, s, m) for s in range(p)]


@pytest.mark.parametrize("name,p,m", GRID, ids=[f"{n}-p{p}-m{m}" for n, p, m in GRID])
def test_every_micro_batch_runs_forward_then_backward_once(name, p, m):
    for s, prog in enumerate(_programs(name, p, m)):
        tag = f"{name} p={p} m={m} stage {s}: {prog}"
        where = {(ins.op, ins.mb): i for i, ins in enumerate(prog)}
        for op in (Op.FORWARD, Op.BACKWARD):
            assert [ins.mb for ins in prog if ins.op is op] == sorted(
                ins.mb for ins in prog if ins.op is op
            ), tag
            assert sorted(ins.mb for ins in prog if ins.op is op) == list(range(m)), tag
        for i in range(m):
            assert where[(Op.FORWARD, i)] < where[(Op.BACKWARD, i)], tag
        loads = [ins.mb for ins in prog if ins.op is Op.LOAD]
        assert loads == (list(range(m)) if s in (0, p - 1) else []), tag
        for i in loads:
            assert where[(Op.LOAD, i)] < where[(Op.FORWARD, i)], tag
        tail = [Op.REDUCE_GRADS, Op.REDUCE_TIED, Op.OPTIMIZER_STEP]
        assert [ins.op for ins in prog[-3:]] == tail, f"{tag}: step only at the end"
        assert sum(ins.op is Op.OPTIMIZER_STEP for ins in prog) == 1, tag


@pytest.mark.parametrize("name,p,m", GRID, ids=[f"{n}-p{p}-m{m}" for n, p, m in GRID])
def test_sends_pair_with_receives_and_the_time_is_the_bubble_formula(name, p, m):
    took = simulate(_programs(name, p, m), t_forward=TF, t_backward=TB)
    assert took == pytest.approx((m + p - 1) * (TF + TB)), f"{name} p={p} m={m}"


@pytest.mark.parametrize("name,p,m", GRID, ids=[f"{n}-p{p}-m{m}" for n, p, m in GRID])
def test_in_flight_bound(name, p, m):
    peaks = [peak_in_flight(prog) for prog in _programs(name, p, m)]
    want = [m] * p if name == "gpipe" else [min(p - s, m) for s in range(p)]
    assert peaks == want, f"{name} p={p} m={m}"


INTERLEAVED = [(2, 2, 2), (2, 2, 8), (2, 3, 4), (4, 2, 4), (4, 2, 8), (4, 3, 16)]


@pytest.mark.parametrize("p,v,m", INTERLEAVED, ids=[f"p{p}-v{v}-m{m}" for p, v, m in INTERLEAVED])
def test_interleaved_shrinks_the_bubble_by_the_number_of_chunks(p, v, m):
    progs = _programs("interleaved", p, m, v)
    took = simulate(progs, chunks=v, t_forward=TF, t_backward=TB)
    ideal = m * (TF + TB)
    assert (took - ideal) / ideal == pytest.approx((p - 1) / (v * m)), f"p={p} v={v} m={m}"
    for s, prog in enumerate(progs):
        units = sorted((ins.mb, ins.chunk) for ins in prog if ins.op is Op.FORWARD)
        assert units == sorted(itertools.product(range(m), range(v))), f"stage {s}"
        # Megatron's warm-up plus the one in steady state, in (micro-batch, chunk) units.
        want = min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1)
        assert peak_in_flight(prog) == want, f"p={p} v={v} m={m} stage {s}"


@pytest.mark.parametrize("p,v,m", INTERLEAVED, ids=[f"p{p}-v{v}-m{m}" for p, v, m in INTERLEAVED])
def test_interleaved_inference_runs_every_chunk_once(p, v, m):
    progs = [inference(p, s, m, v) for s in range(p)]
    assert simulate(progs, chunks=v) > 0
    for prog in progs:
        assert sorted((i.mb, i.chunk) for i in prog if i.op is Op.FORWARD) == sorted(
            itertools.product(range(m), range(v))
        )


def test_interleaved_needs_micro_batches_a_multiple_of_stages():
    with pytest.raises(ScheduleError, match="multiple of stages=4"):
        interleaved(4, 0, 6, 2)


def test_worked_example_d_of_the_reference():
    """papers.md, worked example D: bubble (p-1)/m, idle share of the total (p-1)/(m+p-1),
    DeepSpeed's 2(m+p-1) steps (a step = one forward or one backward: t_f = t_b = 1)."""
    rows = [(2, 4, 0.25, 1 / 5, 10, 2), (2, 8, 0.125, 1 / 9, 18, 2), (4, 8, 0.375, 3 / 11, 22, 4)]
    for p, m, bubble, idle, steps, in_flight in rows:
        progs = _programs("1f1b", p, m)
        took = simulate(progs, t_forward=1, t_backward=1)
        assert took == steps, (p, m)
        assert (took - 2 * m) / (2 * m) == pytest.approx(bubble), (p, m)
        assert (took - 2 * m) / took == pytest.approx(idle), (p, m)
        assert peak_in_flight(progs[0]) == in_flight, (p, m)
        assert peak_in_flight(_programs("gpipe", p, m)[0]) == m, (p, m)


def test_the_simulator_finds_a_deadlock():
    # Stage 0 waits for a gradient before sending the activation that produces it.
    bad = one_f_one_b(2, 0, 1)
    assert repr(bad[2:4]) == "[sA0, rG0]"
    bad[2], bad[3] = bad[3], bad[2]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([bad, one_f_one_b(2, 1, 1)])


def test_the_simulator_finds_receives_out_of_order():
    progs = [gpipe(2, 0, 2), gpipe(2, 1, 2)]
    i, j = progs[1].index(Instruction(Op.RECV_ACT, 0)), progs[1].index(Instruction(Op.RECV_ACT, 1))
    progs[1][i], progs[1][j] = progs[1][j], progs[1][i]
    with pytest.raises(ScheduleError, match="not in the same order"):
        simulate(progs)


def test_the_simulator_finds_an_unreceived_message():
    progs = [gpipe(2, 0, 1), [ins for ins in gpipe(2, 1, 1) if ins.op is not Op.RECV_ACT]]
    with pytest.raises(ScheduleError, match="never received"):
        simulate(progs)


def test_inference_is_forward_only_and_runs():
    progs = [inference(3, s, 4) for s in range(3)]
    assert all(ins.op not in (Op.BACKWARD, Op.OPTIMIZER_STEP) for prog in progs for ins in prog)
    assert simulate(progs, t_forward=1) == pytest.approx(4 + 2)


def test_one_f_one_b_reads_like_the_literature():
    assert repr(one_f_one_b(2, 0, 3)) == (
        "[L0, F0, sA0, L1, F1, sA1, rG0, B0, L2, F2, sA2, rG1, B1, rG2, B2, RG, RT, S]"
    )
    assert repr(one_f_one_b(2, 1, 3)) == (
        "[L0, rA0, F0, B0, sG0, L1, rA1, F1, B1, sG1, L2, rA2, F2, B2, sG2, RG, RT, S]"
    )


@pytest.mark.parametrize(
    "args,match",
    [
        (("zigzag", 2, 0, 4), "expected one of"),
        (("1f1b", 2, 2, 4), "stage_id=2"),
        (("gpipe", 2, 0, 0), "micro_batches=0"),
    ],
)
def test_bad_arguments_are_named(args, match):
    with pytest.raises(ScheduleError, match=match):
        make_schedule(*args)
