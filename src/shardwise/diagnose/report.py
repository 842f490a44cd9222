"""The merged report: which rank never entered which call, and where every rank waits.

Input: the records of the ranks (``dump.py``), from the store or from ``rank<N>.json`` files.
A call is named by its group (name and global ranks) and its sequence number there; the calls
ranks are in flight in ("waits") are checked against the other members of their group:

    never entered   a member's count of calls on that group is below the sequence number.
                    If that member is in no collective itself, it is a root cause (asleep,
                    computing, blocked outside shardwise.comm): those findings come first.
    disagree        members entered call #n of the group with different ops, dtypes or shapes
                    (a skipped or extra call, or another order); the calls per call site on
                    that group, where they differ between ranks, point at the line.
    no record       a member wrote nothing (dead, or blocked in C++ holding Python's lock).

Point-to-point messages are numbered per direction, so a ``recv`` waits for the ``send`` with
the same number on ``<group> p2p <src>-><dst>``. ``shardwise diagnose RUN_DIR`` prints the same
report from the files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from shardwise.diagnose.dump import DEFAULT_DIR

Key = tuple[str, tuple[int, ...]]
_MAX_RANK_LINES = 64
_COMPLEMENT = {"send": "recv", "recv": "send"}


@dataclasses.dataclass
class Finding:
    text: str
    # findings sort by it: root causes first; among those, calls the root alone holds up
    # before calls other ranks are also blocked away from; then the oldest wait
    order: tuple


def _key(call: dict) -> Key:
    return call["group"], tuple(call["ranks"])


def _gdesc(key: Key) -> str:
    return f"group '{key[0]}' (ranks {list(key[1])})"


def ranks_text(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0, 1`` / ``ranks 0-5, 7``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    words = [str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in spans]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(words)


def _site(call: dict) -> str:
    path, line, fn = call["site"]
    return f"{short_path(path)}:{line} in {fn}"


def short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def frame_text(frame: list | None) -> str:
    """``path:line in function: code`` of a recorded frame."""
    if not frame:
        return "(no Python frame)"
    path, line, fn, code = frame
    return f"{short_path(path)}:{line} in {fn}" + (f": {code}" if code else "")


def _signature(call: dict) -> str:
    tensors = [f"{d} {tuple(s)}" for d, s in zip(call["dtypes"], call["shapes"], strict=False)]
    return " ".join([call["op"], *tensors])


class Analysis:
    """The state of every rank and what it implies (built from the records)."""

    def __init__(self, records: dict[int, dict], world_size: int) -> None:
        self.records, self.world_size = records, world_size
        self.entered: dict[int, dict[Key, int]] = {}
        self.calls: dict[int, dict[tuple[Key, int], dict]] = {}
        for r, rec in records.items():
            self.entered[r] = {(g["name"], tuple(g["ranks"])): g["entered"] for g in rec["groups"]}
            known = self.calls[r] = {}
            for call in rec["recent"] + rec["in_flight"]:
                known[(_key(call), call["seq"])] = call
        self.waits: dict[tuple[Key, int], dict[int, dict]] = {}
        for r, rec in sorted(records.items()):
            for call in rec["in_flight"]:
                self.waits.setdefault((_key(call), call["seq"]), {})[r] = call

    def waiting(self, rank: int) -> dict | None:
        flights = self.records[rank]["in_flight"] if rank in self.records else []
        return min(flights, key=lambda c: c["start"]) if flights else None

    def _state(self, rank: int) -> str:
        call = self.waiting(rank)
        if call is not None:
            return f"{ranks_text([rank])} itself waits in {call['op']} #{call['seq']} on {_gdesc(_key(call))}"
        where = frame_text(self.records[rank].get("where"))
        return f"{ranks_text([rank])} is in no collective, at {where}"

    def findings(self) -> list[Finding]:
        out = []
        for (key, seq), waiters in self.waits.items():
            out += self._check(key, seq, waiters)
        seen, unique = set(), []
        for f in sorted(out, key=lambda f: f.order):
            if f.text not in seen:
                seen.add(f.text)
                unique.append(f)
        return unique

    def _check(self, key: Key, seq: int, waiters: dict[int, dict]) -> list[Finding]:
        first = min(waiters.values(), key=lambda c: c["start"])
        since, op = first["start"], first["op"]
        who = ranks_text(list(waiters))
        verb = "waits" if len(waiters) == 1 else "wait"
        age = max(self.records[r]["time"] - c["start"] for r, c in waiters.items())
        out = []
        missing = [
            m
            for m in key[1]
            if m not in waiters and m in self.records and self.entered[m].get(key, 0) < seq
        ]
        # A call that a missing member is blocked away from (it waits in another call) would
        # not complete even if the root rank came: it is downstream of the other call.
        downstream = int(any(self.waiting(m) is not None for m in missing))
        for m in missing:
            theirs = _COMPLEMENT.get(op, op)
            root = self.waiting(m) is None
            text = (
                f"{ranks_text([m])} never entered {theirs} #{seq} on {_gdesc(key)}, where "
                f"{who} {verb} (for {age:.1f} s, from {_site(first)}); {self._state(m)}"
            )
            out.append(Finding(text, (0 if root else 2, downstream, since)))
        if op not in _COMPLEMENT:
            out += self._disagree(key, seq, since)
        if not out and all(self.entered.get(m, {}).get(key, 0) >= seq for m in key[1]):
            text = (
                f"every rank of {_gdesc(key)} entered {op} #{seq}, and it has not completed "
                f"on {who} (for {age:.1f} s): a transport problem, or a peer that died inside it"
            )
            out.append(Finding(text, (2, 0, since)))
        absent = [m for m in key[1] if m not in self.records]
        if absent:
            text = (
                f"{ranks_text(absent)} wrote no record (dead, or blocked in C++ holding Python's "
                f"lock): cannot tell whether they entered {op} #{seq} on {_gdesc(key)}, where {who} {verb}"
            )
            out.append(Finding(text, (3, 0, since)))
        return out

    def _disagree(self, key: Key, seq: int, since: float) -> list[Finding]:
        sides: dict[str, list[tuple[int, dict]]] = {}
        for m in key[1]:
            call = self.calls.get(m, {}).get((key, seq))
            if call is not None:
                sides.setdefault(_signature(call), []).append((m, call))
        if len(sides) < 2:
            return []
        parts = [
            f"\n      {ranks_text([m for m, _ in calls])}: {sig} from {_site(calls[0][1])}"
            for sig, calls in sorted(sides.items(), key=lambda kv: (-len(kv[1]), kv[1][0][0]))
        ]
        text = (
            f"the ranks of {_gdesc(key)} disagree on call #{seq} (a rank skipped a call, made "
            "an extra one, or they call in another order):" + "".join(parts)
        )
        return [Finding(text + self._site_counts(key), (1, 0, since))]

    def _site_counts(self, key: Key) -> str:
        counts: dict[tuple, dict[int, int]] = {}
        for r, rec in self.records.items():
            for s in rec["sites"]:
                if (s["group"], tuple(s["ranks"])) == key:
                    counts.setdefault((s["op"], *s["site"]), {})[r] = s["calls"]
        diffs = []
        for (op, path, line, fn), by_rank in sorted(counts.items(), key=str):
            per = [by_rank.get(r, 0) for r in key[1] if r in self.records]
            if len(set(per)) > 1:
                shown = ", ".join(
                    f"rank {r} {by_rank.get(r, 0)}" for r in key[1] if r in self.records
                )
                diffs.append(f"\n      {op} from {short_path(path)}:{line} in {fn}: {shown}")
        head = (
            "\n    calls on that group per call site, where the ranks differ (in flight included):"
        )
        return head + "".join(diffs) if diffs else ""


def conclusion(records: dict[int, dict], world_size: int, most: int = 3) -> str:
    """The first findings, one per line (what a failing collective's error carries)."""
    found = Analysis(records, world_size).findings()
    if not found:
        return "shardwise diagnosis: no rank waits for another in the records"
    lines = [f"shardwise diagnosis: {f.text}" for f in found[:most]]
    if len(found) > most:
        lines.append(f"({len(found) - most} more findings in the report)")
    return "\n".join(lines)


def _rank_lines(a: Analysis) -> list[str]:
    lines = []
    for r in range(a.world_size):
        if len(lines) >= _MAX_RANK_LINES:
            lines.append(f"  ... ({a.world_size - r} more ranks: see their rank<N>.json)")
            break
        rec = a.records.get(r)
        if rec is None:
            lines.append(f"  rank {r}: no record")
            continue
        call = a.waiting(r)
        if call is not None:
            tensors = _signature(call).removeprefix(call["op"]).strip()
            state = (
                f"waits in {call['op']} #{call['seq']} ({tensors or 'no tensor'}) on "
                f"{_gdesc(_key(call))} for "
                f"{rec['time'] - call['start']:.1f} s, called from {_site(call)}"
            )
        else:
            last = rec["recent"][-1] if rec["recent"] else None
            state = "in no collective" + (
                f" (last: {last['op']} #{last['seq']} on group '{last['group']}')" if last else ""
            )
        lines.append(f"  rank {r} ({rec['host']}, pid {rec['pid']}): {state}")
        lines.append(f"      at {frame_text(rec.get('where'))}")
    return lines


def _group_lines(a: Analysis) -> list[str]:
    keys = sorted({k for e in a.entered.values() for k in e})
    lines = []
    for key in keys:
        by_count: dict[int, list[int]] = {}
        for m in key[1]:
            if m in a.entered:
                by_count.setdefault(a.entered[m].get(key, 0), []).append(m)
        mark = "*" if len(by_count) > 1 else " "
        shown = "; ".join(f"#{n}: {ranks_text(rs)}" for n, rs in sorted(by_count.items()))
        lines.append(f" {mark}{key[0]} {list(key[1])}: {shown}")
    return lines


def format_report(records: dict[int, dict], world_size: int, where: str = "") -> str:
    """The whole report: conclusion, each rank's state, the calls entered per group."""
    a = Analysis(records, world_size)
    found = a.findings()
    starts = [c["start"] for rec in records.values() for c in rec["in_flight"]]
    first = min(starts) if starts else None
    reasons = sorted(
        {rec["reason"] for rec in records.values() if "saw a hang" not in rec["reason"]}
    )
    head = [
        f"shardwise diagnose: records of {len(records)} of {world_size} ranks"
        + (f" in {where}" if where else ""),
        f"  trigger: {reasons[0] if reasons else '(none)'}",
    ]
    if first is not None:
        head.append(
            f"  oldest waiting call began {time.strftime('%H:%M:%S', time.localtime(first))}; "
            f"records written {max(r['time'] for r in records.values()) - first:.1f} s later"
        )
    body = ["", "Conclusion:"] + ([f"  - {f.text}" for f in found] or ["  (no rank waits)"])
    body += ["", "Each rank:"] + _rank_lines(a)
    body += ["", "Calls entered per group (* where the ranks differ):"] + _group_lines(a)
    return "\n".join(head + body)


def read_dir(
    directory: Path, job: str | None = None, since: float | None = None
) -> dict[int, dict]:
    """The ``rank<N>.json`` records in ``directory`` (of ``job``, written after ``since``)."""
    out: dict[int, dict] = {}
    for path in sorted(Path(directory).glob("rank*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if job is not None and data.get("job") != job:
            continue
        if since is not None and data.get("time", 0) < since:
            continue
        out[int(data["rank"])] = data
    return out


def find_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` itself, or its ``diagnose/`` or ``shardwise-diagnose/``, whichever holds records."""
    base = Path(path)
    for d in (base, base / "diagnose", base / DEFAULT_DIR):
        if any(d.glob("rank*.json")):
            return d
    raise ValueError(
        f"no rank<N>.json records in {base}, {base / 'diagnose'} or {base / DEFAULT_DIR}: give "
        "the run directory (SHARDWISE_RUN_DIR / shardwise run --run-dir) or the diagnose folder"
    )


def write_report(directory: Path, text: str) -> Path:
    """``directory/report.txt``, whole or not at all (a rank killed mid-write leaves no half)."""
    path = directory / "report.txt"
    tmp = path.with_suffix(f".txt.tmp{os.getpid()}")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    return path


def settle(directory: Path, since: float) -> str | None:
    """After a failed job: the conclusion of the records its ranks wrote after ``since``, writing
    ``report.txt`` from them when no rank did (the reporting rank was stopped, or died, before it
    finished: the launcher kills the others when one exits); None when no rank wrote a record.
    """
    every = read_dir(directory, since=since)
    if not every:
        return None
    newest = max(every.values(), key=lambda d: d.get("time", 0))
    records = {r: d for r, d in every.items() if d.get("job") == newest.get("job")}
    world = max(d.get("world_size", 0) for d in records.values())
    path = directory / "report.txt"
    if not path.exists() or path.stat().st_mtime < newest.get("time", 0):
        write_report(directory, format_report(records, world, str(directory)))
    return f"{conclusion(records, world)}\n(report: {path})"


def load(path: str | os.PathLike[str]) -> tuple[Path, dict[int, dict]]:
    """The records of the newest job in ``path``'s diagnose folder, by rank."""
    directory = find_dir(path)
    every = read_dir(directory)
    newest = max(every.values(), key=lambda d: d.get("time", 0))
    return directory, {r: d for r, d in every.items() if d.get("job") == newest.get("job")}
