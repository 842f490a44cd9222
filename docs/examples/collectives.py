"""Every collective of ``shardwise.comm`` on 4 processes: what each rank holds before and after.

    python docs/examples/collectives.py

``shardwise.spawn`` starts 4 processes on this machine with a gloo process group. Each runs
``run_all``: for every operation it records its tensors before and after the call, then the
bytes ``shardwise.comm.stats()`` counted. The parent prints one table per operation and one
table of bytes. ``-`` marks a buffer whose content does not matter (an output not yet
written). Values are chosen so that the tens digit names the rank the data came from.
Explained in docs/collectives.md.
"""

from __future__ import annotations

import torch

import shardwise
from shardwise import comm
from shardwise.topology import new_subgroup

NPROCS = 4
ROOT = 0

# What each operation does, printed above its table.
TITLES = {
    "broadcast": f"broadcast(src={ROOT}): every rank gets the root's tensor",
    "scatter": f"scatter(src={ROOT}): rank i gets chunk i of the root's list",
    "gather": f"gather(dst={ROOT}): the root gets every rank's tensor, in rank order",
    "reduce": f"reduce(dst={ROOT}, SUM): the root gets the sum",
    "all_reduce": "all_reduce(SUM): every rank gets the sum",
    "all_gather": "all_gather: every rank gets every rank's tensor, in rank order",
    "reduce_scatter": "reduce_scatter(SUM): rank i gets chunk i of the sum",
    "all_to_all": "all_to_all: rank i sends its chunk j to rank j (a transpose)",
    "send/recv": "send/recv: rank 0 sends to rank 1, rank 2 to rank 3 (point to point)",
    "all_reduce(evens)": "all_reduce over the group of even ranks [0, 2]; odd ranks take no part",
}


def _show(t: object) -> str:
    """A tensor (or list of tensors) as integers; None as '-'."""
    if t is None:
        return "-"
    if isinstance(t, list):
        return " | ".join(_show(x) for x in t)
    return "[" + " ".join(str(int(v)) for v in t.tolist()) + "]"


def _mine(r: int, n: int = 2) -> torch.Tensor:
    """Rank r's own data: [10(r+1), 10(r+1)+1, ...]."""
    return torch.arange(n, dtype=torch.float32) + 10 * (r + 1)


def rooted(r: int, n: int) -> dict:
    """broadcast, scatter, gather, reduce: one rank (ROOT) is special."""
    out = {}
    t = _mine(r)
    before = _show(t)
    comm.broadcast(t, src=ROOT)
    out["broadcast"] = (before, _show(t))
    chunks = [torch.tensor([2.0 * i, 2.0 * i + 1]) for i in range(n)] if r == ROOT else None
    got = torch.empty(2)
    comm.scatter(got, chunks, src=ROOT)
    out["scatter"] = (_show(chunks), _show(got))
    parts = [torch.empty(2) for _ in range(n)] if r == ROOT else None
    comm.gather(_mine(r), parts, dst=ROOT)
    out["gather"] = (_show(_mine(r)), _show(torch.cat(parts)) if parts else "-")
    t = _mine(r)
    comm.reduce(t, dst=ROOT)
    out["reduce"] = (_show(_mine(r)), _show(t) if r == ROOT else "(scratch space: do not read)")
    return out


def symmetric(r: int, n: int) -> dict:
    """all_reduce, all_gather, reduce_scatter, all_to_all: every rank alike."""
    out = {}
    t = _mine(r)
    comm.all_reduce(t)
    out["all_reduce"] = (_show(_mine(r)), _show(t))
    full = torch.empty(2 * n)
    comm.all_gather_into_tensor(full, _mine(r))
    out["all_gather"] = (_show(_mine(r)), _show(full))
    x = (r + 1) * torch.arange(1.0, 2 * n + 1)  # 2n values: chunk i = elements 2i, 2i+1
    shard = torch.empty(2)
    comm.reduce_scatter_tensor(shard, x)
    out["reduce_scatter"] = (_show(x), _show(shard))
    x = _mine(r, n)  # element j goes to rank j
    y = torch.empty(n)
    comm.all_to_all_single(y, x)
    out["all_to_all"] = (_show(x), _show(y))
    return out


def point_to_point(r: int) -> dict:
    """Even ranks send to the next rank; odd ranks receive. Blocking calls pair up."""
    if r % 2 == 0:
        comm.send(_mine(r), dst=r + 1)
        return {"send/recv": (_show(_mine(r)), f"{_show(_mine(r))} sent to {r + 1}")}
    buf = torch.empty(2)
    src = comm.recv(buf, src=r - 1)
    return {"send/recv": ("-", f"{_show(buf)} from {src}")}


def run_all(rank: int) -> dict:
    """Run on every rank by shardwise.spawn: before/after of every operation, and the bytes."""
    n = comm.get_world_size()
    evens = new_subgroup(range(0, n, 2))  # every rank creates it, members or not
    comm.reset_stats()
    out = {**rooted(rank, n), **symmetric(rank, n), **point_to_point(rank)}
    stats = comm.stats()  # before the subgroup call: counts of the ten operations above
    t = _mine(rank)
    if rank % 2 == 0:
        comm.all_reduce(t, group=evens)
        out["all_reduce(evens)"] = (_show(_mine(rank)), _show(t))
    else:
        out["all_reduce(evens)"] = (_show(_mine(rank)), "(not a member: no call)")
    return {"tables": out, "stats": stats}


# The ring model of shardwise/comm.py's docstring: bytes a rank sends for a payload of S bytes.
FORMULAS = {
    "broadcast": "(N-1)/N*S",
    "scatter": "(N-1)/N*S on the root",
    "gather": "S/N off the root",
    "reduce": "(N-1)/N*S",
    "all_reduce": "2(N-1)/N*S",
    "all_gather": "(N-1)/N*S",
    "reduce_scatter": "(N-1)/N*S",
    "all_to_all": "(N-1)/N*S",
    "send": "S",
    "recv": "0",
}


def ring_model(op: str, payload: int, n: int, rank: int) -> int:
    """The FORMULAS above as numbers."""
    per = (n - 1) / n * payload
    if op == "all_reduce":
        return round(2 * per)
    if op == "scatter":
        return round(per) if rank == ROOT else 0
    if op == "gather":  # every rank but the root sends its chunk
        return 0 if rank == ROOT else round(payload / n)
    return {"send": payload, "recv": 0}.get(op, round(per))


def _bytes_table(results: list[dict]) -> list[str]:
    n = len(results)
    ranks = "".join(f"{'rank ' + str(r):>8}" for r in range(n))
    lines = [
        f"comm.stats(): bytes each rank sent (fp32: 4 bytes per element, N={n})",
        f"  {'op':<15}{'payload S':>10}{ranks}   ring model",
    ]
    for op, formula in FORMULAS.items():
        counts = [res["stats"].get(op, {"bytes": 0, "sent_bytes": 0}) for res in results]
        payload = max(c["bytes"] for c in counts)
        sent = [c["sent_bytes"] for c in counts]
        model = [ring_model(op, payload if c["bytes"] else 0, n, r) for r, c in enumerate(counts)]
        differs = "" if sent == model else f"  (differs: model gives {model})"
        cells = "".join(f"{s:>8}" for s in sent)
        lines.append(f"  {op:<15}{payload:>10}{cells}   {formula}{differs}")
    return lines


def report(results: list[dict]) -> str:
    lines = []
    for op, title in TITLES.items():
        rows = [res["tables"][op] for res in results]
        w = max(len("before"), *(len(b) for b, _ in rows))
        lines += [title, f"  rank  {'before'.ljust(w)}  after"]
        lines += [f"  {r:>4}  {b.ljust(w)}  {a}" for r, (b, a) in enumerate(rows)]
        lines.append("")
    return "\n".join(lines + _bytes_table(results))


def main() -> None:
    results = shardwise.spawn(run_all, nprocs=NPROCS, backend="gloo", timeout=120)
    print(report(results), flush=True)


if __name__ == "__main__":
    main()
