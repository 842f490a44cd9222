"""Hangs explained (issue 13; docs/reliability.md, "Hangs"; shardwise/diagnose/).

Each hang kind is a real launch (``shardwise run --timeout 5``) of tests/scripts/hang.py: the
job must exit non-zero and, within timeout + 10 s of the hang, leave a report in the run
directory that names the rank that never came (or the two sides that disagree), the op and the
group; torchrun's Root Cause must carry that conclusion, and ``shardwise diagnose RUN_DIR``
must print the same from the files. The fingerprint debug check and the report's reading of
point-to-point waits run without a launch.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import capture_logs, run_distributed
from waits import scaled, scaled_int

import shardwise
from shardwise import comm
from shardwise.config import ConfigError, parse_config
from shardwise.diagnose import report
from shardwise.launch.cli import main

SCRIPT = Path(__file__).parent / "scripts" / "hang.py"
TIMEOUT = scaled_int(5)  # seconds: every group's collective timeout in the launches
DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _at(marker: str) -> str:
    """``path:N`` of the script's line holding ``marker``, as reports show it (from the cwd)."""
    lines = SCRIPT.read_text().splitlines()
    return (
        f"{report.short_path(str(SCRIPT))}:{next(i for i, t in enumerate(lines, 1) if marker in t)}"
    )


GRADS = _at("the step's gradient all-reduce")
BARRIER = _at("everyone meets")
EXTRA = _at("one all-reduce more")

# kind, processes, what the first finding of the conclusion must say (in this order)
CASES = [
    (
        "sleep-world",
        2,
        [
            "rank 1 never entered all_reduce #1 on group 'world' (ranks [0, 1]), where rank 0 waits",
            f"{GRADS} in grads",
            f"rank 1 is in no collective, at {_at('rank 1 never comes')} in train: time.sleep(3600)",
        ],
    ),
    (
        "sleep-data",
        4,
        [
            "rank 3 never entered all_reduce #3 on group 'data' (ranks [1, 3]), where rank 1 waits",
            f"rank 3 is in no collective, at {_at('rank 3 never comes')} in train",
        ],
    ),
    (
        "skip",
        2,
        [
            "the ranks of group 'world' (ranks [0, 1]) disagree on call #3",
            f"rank 0: all_reduce float32 (4,) from {GRADS}",
            f"rank 1: barrier from {BARRIER}",
            f"all_reduce from {GRADS} in grads: rank 0 3, rank 1 2",
        ],
    ),
    (
        "own",
        2,
        [
            "rank 1 never entered all_reduce #1 on group 'metrics' (ranks [0, 1]), where rank 0 "
            "waits",
            f"{_at('the script' + chr(39) + 's own all-reduce')} in own_metrics",
            f"rank 1 is in no collective, at {_at('rank 1 never sends')} in own_metrics",
        ],
    ),
    (
        "extra",
        2,
        [
            "the ranks of group 'world' (ranks [0, 1]) disagree on call #4",
            f"rank 0: all_reduce float32 (4,) from {GRADS}",
            f"rank 1: barrier from {BARRIER}",
            f"all_reduce from {EXTRA} in train: rank 0 1, rank 1 0",
        ],
    ),
]
# The reporting rank stopped before its report (a loaded machine, issue 32): the launcher
# writes it from the records, with the same conclusion.
CASES.append(("extra-slow-report", 2, CASES[-1][2]))


def _launch(kind: str, nproc: int, run_dir: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in DROP}
    cmd = [sys.executable, "-m", "shardwise", "run", "--nproc-per-node", str(nproc)]
    cmd += ["--timeout", str(TIMEOUT), "--run-dir", str(run_dir), str(SCRIPT), kind]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=scaled(240))


def _section(text: str, title: str) -> str:
    return text.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0]


@pytest.mark.parametrize("kind, nproc, expected", CASES, ids=[c[0] for c in CASES])
def test_a_hang_is_reported_naming_rank_op_and_group(kind, nproc, expected, tmp_path, capsys):
    out = _launch(kind, nproc, tmp_path)
    assert out.returncode != 0, f"{kind}: a hung job must exit non-zero\n{out.stderr[-3000:]}"
    folder = tmp_path / "diagnose"
    text = (folder / "report.txt").read_text()
    first = _section(text, "Conclusion:").split("\n  - ")[0]
    for phrase in expected:
        assert phrase in first, f"{kind}: {phrase!r} missing from the first finding:\n{text}"

    records = report.read_dir(folder)
    assert sorted(records) == list(range(nproc)), f"{kind}: every rank writes its record: {text}"
    hang = min(c["start"] for r in records.values() for c in r["in_flight"])
    late = (folder / "report.txt").stat().st_mtime - hang
    assert late <= TIMEOUT + scaled(10), (
        f"{kind}: report {late:.1f} s after the hang (timeout {TIMEOUT})"
    )

    summary = out.stderr[out.stderr.rfind("Root Cause") :]
    assert f"shardwise diagnosis: {expected[0]}" in summary, f"{kind}: root cause\n{summary}"

    assert main(["diagnose", str(tmp_path)]) == 0
    offline = capsys.readouterr().out
    assert _section(offline, "Conclusion:") == _section(text, "Conclusion:"), (
        f"{kind}: shardwise diagnose must conclude as rank 0 did:\n{offline}"
    )


def _mismatched(kind: str) -> tuple[str, list[float]]:
    """Rank 1 calls all_reduce with another dtype (same bytes) or another size."""
    rec = comm.recorder()
    rec.configure(fingerprint=True)
    other = torch.ones(4, dtype=torch.int32) if kind == "dtype" else torch.ones(5)
    try:
        try:
            comm.all_reduce(torch.ones(4) if comm.get_rank() == 0 else other)  # the mismatch
            message = "no error"
        except RuntimeError as e:
            message = f"{type(e).__name__}: {e}"
        after = torch.ones(2)
        comm.all_reduce(after)  # the check ran before the call: the group still works
        return message, after.tolist()
    finally:
        rec.configure(fingerprint=False)


@pytest.mark.parametrize(
    "kind, rank0, rank1",
    [
        ("dtype", "rank 0: all_reduce #{} float32 (4,)", "rank 1: all_reduce #{} int32 (4,)"),
        ("shape", "rank 0: all_reduce #{} float32 (4,)", "rank 1: all_reduce #{} float32 (5,)"),
    ],
)
def test_fingerprint_mode_names_both_sides(kind, rank0, rank1):
    results = run_distributed(_mismatched, 2, kind)
    for r, (message, after) in enumerate(results):
        where = f"{kind}, rank {r}"
        assert message.startswith("CollectiveMismatchError: collective mismatch in call #"), (
            f"{where}: {message}"
        )
        seq = message.split("call #", 1)[1].split(" ", 1)[0]
        assert "on group 'world' (ranks [0, 1])" in message, f"{where}: {message}"
        for side in (rank0.format(seq), rank1.format(seq)):
            assert side in message, f"{where}: {side!r} missing from {message}"
        assert message.count("test_hang.py:") == 2, f"{where}: both call sites: {message}"
        assert after == [2.0, 2.0], f"{where}: the group must work after the refused call"


def _p2p_record(rank: int, in_flight: list[dict], entered: dict) -> dict:
    """``entered``: calls per group, keyed by name (ranks [0, 1]) or by (name, ranks)."""
    groups = [
        {"name": g, "ranks": [0, 1], "entered": n, "completed": n}
        if isinstance(g, str)
        else {"name": g[0], "ranks": list(g[1]), "entered": n, "completed": n}
        for g, n in entered.items()
    ]
    return {
        "rank": rank, "time": 100.0, "host": "h", "pid": rank, "reason": "test", "groups": groups,
        "in_flight": in_flight, "recent": in_flight, "sites": [], "where": ["train.py", 9, "main", "x"],
    }  # fmt: skip


def test_a_receive_waits_for_the_numbered_send():
    """p2p messages are numbered per direction: rank 1 waits for message #3 from rank 0, which
    has sent two and now waits at the world barrier."""
    recv = {"seq": 3, "op": "recv", "group": "world p2p 0->1", "ranks": [0, 1], "shapes": [[4]],
            "dtypes": ["float32"], "start": 90.0, "site": ["stage.py", 5, "recv_act"]}  # fmt: skip
    barrier = {**recv, "seq": 1, "op": "barrier", "group": "world", "shapes": [], "dtypes": []}
    records = {
        0: _p2p_record(0, [barrier], {"world p2p 0->1": 2, "world": 1}),
        1: _p2p_record(1, [recv], {"world p2p 0->1": 3}),
    }
    found = report.conclusion(records, 2)
    want = "rank 0 never entered send #3 on group 'world p2p 0->1' (ranks [0, 1]), where rank 1"
    assert want in found, found
    assert "rank 0 itself waits in barrier #1 on group 'world'" in found, found


@pytest.mark.parametrize("barrier_first", [True, False], ids=["barrier-older", "barrier-newer"])
def test_the_call_the_root_alone_holds_up_comes_first(barrier_first):
    """sleep-data as the records saw it: rank 3 sleeps before data all_reduce #3 (ranks 1, 3),
    so rank 1 waits there and ranks 0, 2 wait at the world barrier for ranks 1 and 3. Both
    calls miss rank 3, but only the all_reduce would complete if rank 3 came: it is first,
    whichever wait began earlier (CI once saw the barrier first when it was the older)."""
    start = (80.0, 85.0) if barrier_first else (85.0, 80.0)
    call = {"op": "all_reduce", "shapes": [[4]], "dtypes": ["float32"], "site": ["t.py", 5, "g"]}
    data = {**call, "seq": 3, "group": "data", "ranks": [1, 3], "start": start[1]}
    barrier = {**call, "seq": 1, "op": "barrier", "group": "world", "ranks": [0, 1, 2, 3],
               "shapes": [], "dtypes": [], "start": start[0]}  # fmt: skip
    world = ("world", (0, 1, 2, 3))
    records = {
        0: _p2p_record(0, [barrier], {world: 1, ("data", (0, 2)): 3}),
        1: _p2p_record(1, [data], {world: 0, ("data", (1, 3)): 3}),
        2: _p2p_record(2, [{**barrier}], {world: 1, ("data", (0, 2)): 3}),
        3: _p2p_record(3, [], {world: 0, ("data", (1, 3)): 2}),
    }
    first = report.conclusion(records, 4).splitlines()[0]
    want = "rank 3 never entered all_reduce #3 on group 'data' (ranks [1, 3]), where rank 1 waits"
    assert want in first, f"barrier_first={barrier_first}: {first}"


@pytest.mark.parametrize(
    "block, named",
    [
        ({"timeout_s": 0}, "comms.timeout_s: must be > 0"),
        ({"flight_recorder": -1}, "comms.flight_recorder: must be >= 0"),
        ({"fingerprint": "yes"}, "comms.fingerprint: expected true or false"),
        ({"timout_s": 5}, "did you mean 'timeout_s'"),
    ],
)
def test_the_comms_block_is_checked(block, named):
    with pytest.raises(ConfigError) as info:
        parse_config({"comms": block})
    assert named in str(info.value), f"{block}: {info.value}"


def test_records_of_another_job_are_not_merged(tmp_path):
    """A diagnose folder reused by a later job: the report reads the newest job's records."""
    for rank, job, t in ((0, "new/0", 200.0), (1, "old/0", 100.0)):
        data = {"rank": rank, "job": job, "time": t, "world_size": 2}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(data))
    directory, records = report.load(tmp_path)
    assert directory == tmp_path and sorted(records) == [0], f"rank 1's record is older: {records}"


class _Stop(Exception):
    pass


def test_initialize_sets_up_the_world_with_the_config_timeout(monkeypatch):
    seen = {}

    def init_distributed(**kwargs):
        seen.update(kwargs)
        raise _Stop

    module = importlib.import_module(
        "shardwise.training.initialize"
    )  # the attribute is the function
    monkeypatch.setattr(module, "init_distributed", init_distributed)
    config = {"train_batch_size": 1, "comms": {"timeout_s": 42}}
    with pytest.raises(_Stop):
        shardwise.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert seen.get("timeout") == 42, f"init_distributed got {seen}"


def _late_timeout() -> list[str]:
    config = {"train_batch_size": 2, "comms": {"timeout_s": 42, "fingerprint": True}}
    model = torch.nn.Linear(2, 2)
    _, lines = capture_logs(lambda: shardwise.initialize(model=model, config=config))
    fingerprint = comm.recorder().fingerprint
    comm.recorder().configure(fingerprint=False)
    return [line for line in lines if "timeout_s" in line] + [f"fingerprint={fingerprint}"]


def test_a_world_set_up_before_keeps_its_timeout_and_says_so():
    for r, lines in enumerate(run_distributed(_late_timeout, 2)):
        assert "fingerprint=True" in lines, f"rank {r}: the comms block configures the recorder"
        said = [line for line in lines if "has no effect" in line]
        assert said and "init_distributed(timeout=42)" in said[0], f"rank {r}: {lines}"


def _recorded() -> dict:
    rec, rank = comm.recorder(), comm.get_rank()
    work = comm.all_reduce(torch.ones(3), async_op=True)
    in_flight = [c.op for c in rec.in_flight()]
    work.wait()
    if rank == 0:
        comm.send(torch.ones(2), dst=1)
        comm.isend(torch.ones(2, 2), dst=1).wait()
    else:
        comm.recv(torch.empty(2), src=0)
        comm.irecv(torch.empty(2, 2), src=0).wait()
    calls = [(c.op, c.group.name, c.group.ranks, c.seq, c.shapes) for c in rec.recent()[-3:]]
    return {"in_flight": in_flight, "calls": calls, "open": [c.op for c in rec.in_flight()]}


def test_the_recorder_numbers_collectives_per_group_and_messages_per_direction():
    sent, got = run_distributed(_recorded, 2)
    for r, out in enumerate((sent, got)):
        assert out["in_flight"] == ["all_reduce"], f"rank {r}: async call open until wait: {out}"
        assert out["open"] == [], f"rank {r}: every call closed once waited for: {out}"
    (op0, g0, ranks0, seq0, _), *p2p0 = sent["calls"]
    (op1, g1, ranks1, seq1, _), *p2p1 = got["calls"]
    assert (op0, g0, ranks0) == (op1, g1, ranks1) == ("all_reduce", "world", (0, 1))
    assert seq0 == seq1, f"both ranks number the world's calls alike: {seq0} vs {seq1}"
    ops = [[c[0] for c in p2p0], [c[0] for c in p2p1]]
    assert ops == [["send", "send"], ["recv", "recv"]], ops
    for side in (p2p0, p2p1):
        assert {c[1] for c in side} == {"world p2p 0->1"} and {c[2] for c in side} == {(0, 1)}
    assert [c[3] for c in p2p0] == [c[3] for c in p2p1], f"message numbers agree: {p2p0} {p2p1}"
    assert [c[4] for c in p2p0] == [((2,),), ((2, 2),)], f"shapes recorded: {p2p0}"
