"""Hierarchical ZeRO on two throttled hosts: flat ZeRO-3, MiCS, hpZ, ZeRO++ quantized, FSDP2 HSDP.

    sudo python benchmarks/hierarchical.py          # root: it makes network namespaces

Two hosts are two Linux network namespaces joined by a veth pair (tests/netns_hosts.py, the
test suite's own), each end throttled by ``tc`` to 1 Gbit/s (netem with 1 ms of delay when the
kernel has sch_netem, else tbf: rate only, and the driver says so), so the link between the
hosts is the slow one and the loopback inside a host is the fast one, as on a cluster. Each host launches 2 ranks (``python -m shardwise run``, or ``--launcher torch``:
torch.distributed.run), world 4, gloo, one thread per rank. In that one world, five
contenders are built from the same seeded weights (common.py's GPT) and trained on the same
batches with the same torch AdamW, interleaved in rounds:

    shardwise ZeRO-3      flat: every all-gather and reduce-scatter spans both hosts
    MiCS                  mics_shard_size 2: shard inside a host, all-reduce shards across
    hpZ                   zero_hpz_partition_size 2: backward's re-gather from a host copy
    ZeRO++ quantized      zero_quantized_weights + zero_quantized_gradients (int8 / int4)
    torch FSDP2 HSDP      fully_shard on a (replicate 2, shard 2) mesh, blocks then root

every shardwise contender with stage3_param_persistence_threshold 0 (every tensor sharded).
Per contender: the median step time (slowest rank, timed between barriers), and bytes per step
on the link, three ways: (1) measured, the veth ends' tx_bytes counters (both directions, IP
headers and the launcher's heartbeats included); (2) what shardwise's comm log sends on groups
that span both hosts (``shardwise.comm``'s ring-model sent bytes of each recorded call, whose
sum is checked against ``shardwise.comm.stats()``); (3) the share of (2) a ring actually puts
on the link: a rank's bytes cross only when its successor in the group's ring is on the other
host (half the hops of a 4-rank ring over 2 hosts; both hops of a 2-rank cross-host ring).
FSDP2's collectives are torch's own, not in shardwise's log: only (1) for it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # run as a script: find common.py
from common import add_model_args, format_table, make_batches, make_model  # noqa: E402

# name -> zero_optimization keys beside stage 3 (None: torch FSDP2 HSDP)
CONTENDERS: dict[str, dict | None] = {
    "shardwise ZeRO-3 flat": {},
    "MiCS (shard 2)": {"mics_shard_size": 2},
    "hpZ (partition 2)": {"zero_hpz_partition_size": 2},
    "ZeRO++ qwZ + qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
    "torch FSDP2 HSDP": None,
}
REFERENCE = "torch FSDP2 HSDP"
LINK_ENV = "SW_HIER_LINK"  # the veth end of this host, set by the driver per host
MB = 1e6


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(d_model=256, layers=4, seq=64, micro_batch=2, rounds=3, steps=4)
    p.add_argument("--rate", default="1gbit", help="tc netem rate of each direction of the link")
    p.add_argument("--delay", default="1ms", help="tc netem one-way delay")
    p.add_argument("--launcher", choices=("shardwise", "torch"), default="shardwise")
    p.add_argument("--port", type=int, default=29631, help="the master's port on host 0")
    p.add_argument("--only", default="", help="comma-separated contender names (default: all)")
    p.add_argument(
        "--probe",
        action="store_true",
        help="instead: link bytes of one 16 MiB all-reduce, all-gather, reduce-scatter",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the driver
    args = p.parse_args(argv)
    names = [s.strip() for s in args.only.split(",") if s.strip()] or list(CONTENDERS)
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        p.error(f"--only: unknown {unknown}; choose among {list(CONTENDERS)}")
    args.names = names
    return args


# ----------------------------------------------------------------------------- byte models


def ring_link_bytes(op: str, sent: float, ranks: Sequence[int], me: int, per_host: int) -> float:
    """The part of ``sent`` (this rank's ring-model bytes for one call on the group ``ranks``)
    that crosses between hosts: all of it when this rank's ring successor is on another host,
    none otherwise; an all-to-all spreads it evenly over the other ranks."""
    others = [r for r in ranks if r != me]
    if not others:
        return 0.0
    if op == "all_to_all":
        away = sum(r // per_host != me // per_host for r in others)
        return sent * away / len(others)
    order = sorted(ranks)
    successor = order[(order.index(me) + 1) % len(order)]
    return sent if successor // per_host != me // per_host else 0.0


def sent_bytes(op: str, payload: int, n: int) -> float:
    """shardwise.comm's ring model of what one rank sends (its module docstring); gather and
    scatter are taken as sent by a non-root / the root respectively, rare in a step."""
    if op == "all_reduce":
        return 2 * (n - 1) / n * payload
    if op in ("send",):
        return payload
    if op in ("recv", "barrier"):
        return 0.0
    if op == "gather":
        return payload / n
    return (n - 1) / n * payload


def comm_log_bytes(calls: list, me: int, per_host: int) -> tuple[float, float, float]:
    """(all sent, sent on groups spanning hosts, ring share on the link) over ``calls``."""
    total = cross = link = 0.0
    for c in calls:
        ranks = c.group.ranks
        s = sent_bytes(c.op, c.nbytes, len(ranks))
        total += s
        if len({r // per_host for r in ranks}) > 1:
            cross += s
            link += ring_link_bytes(c.op, s, ranks, me, per_host)
    return total, cross, link


# ----------------------------------------------------------------------------- the report


@dataclass
class Result:
    name: str
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    veth: float = 0.0  # link bytes per step, both directions, measured
    log_cross: float | None = None  # comm log: bytes per step sent on cross-host groups
    log_link: float | None = None  # ring model: of those, bytes per step on the link


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def report(results: list[Result]) -> str:
    """The table, ratios to FSDP2 HSDP (or to the first contender when it did not run)."""
    ref = next((r for r in results if r.name == REFERENCE), results[0])
    ref_ms = statistics.median(ref.times)
    headers = ["contender", "median ms", "ms / HSDP", "link MB/step (veth)", "link / HSDP"]
    headers += ["log: cross-host groups MB", "log: ring on link MB", "veth / ring", "final loss"]
    rows = []
    for r in results:
        ms = statistics.median(r.times)
        mb = None if r.log_link is None else r.log_link / MB
        rows.append(
            [r.name, f"{1e3 * ms:.0f}", f"{ms / ref_ms:.2f}", f"{r.veth / MB:.2f}"]
            + [_ratio(r.veth, ref.veth), "-" if r.log_cross is None else f"{r.log_cross / MB:.2f}"]
            + ["-" if mb is None else f"{mb:.2f}", _ratio(r.veth, r.log_link)]
            + [f"{r.losses[-1]:.4f}"]
        )
    return format_table(headers, rows)


# ----------------------------------------------------------------------------- the workers


def build(name: str, args: argparse.Namespace) -> tuple[Callable, Callable]:
    """(forward + backward returning the loss, update) of one contender, from seed 0."""
    import torch
    import torch.distributed as dist
    from zero_peers import adamw, engine_config

    model = make_model(args)
    extra = CONTENDERS[name]
    if extra is None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # torchtitan's HSDP: dim 0 replicates across hosts, dim 1 shards inside one.
        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2),
                                mesh_dim_names=("replicate", "shard"))  # fmt: skip
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = adamw(model.parameters())

        def backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = model(x, y)
            loss.backward()
            return loss

        def update() -> None:
            opt.step()
            opt.zero_grad()

        return backward, update
    import shardwise

    args.bucket_elements, args.prefetch_elements, args.persistence_threshold = 2**22, 5e7, 0
    config = engine_config(args, 3, "fp32")
    config["zero_optimization"].update(extra)
    engine, *_ = shardwise.initialize(model=model, optimizer=adamw(model.parameters()),
                                      config=config)  # fmt: skip

    def backward_ours(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = engine(x, y)
        engine.backward(loss)
        return loss

    return backward_ours, engine.step


def tx_bytes() -> int:
    """This host's bytes sent on the link (local rank 0 reads it; the others count 0)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return 0
    return int(Path(f"/sys/class/net/{os.environ[LINK_ENV]}/statistics/tx_bytes").read_text())


def run_block(r: Result, fns: tuple, batches: list, first: int, args: argparse.Namespace) -> None:
    """``args.warmup`` untimed then ``args.steps`` timed steps; bytes counted over the timed."""
    import torch
    import torch.distributed as dist

    import shardwise.comm as comm

    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
    backward, update = fns
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
            tx0, t_window, stats0 = tx_bytes(), time.time(), comm.total_sent_bytes()
        x, y = batches[first + i]
        rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        dist.barrier()
        t0 = time.perf_counter()
        loss = backward(x[rows], y[rows])
        update()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    tx1 = tx_bytes()
    calls = [c for c in comm.recorder().recent() if c.start >= t_window]
    total, cross, link = comm_log_bytes(calls, rank, per_host)
    logged = comm.total_sent_bytes() - stats0
    if abs(total - logged) > 0.01 * max(logged, 1):
        print(f"[rank {rank}] {r.name}: recorder holds {total:.0f} B of stats()' {logged} B")
    sums = torch.tensor([tx1 - tx0, cross, link, *losses], dtype=torch.float64)
    dist.all_reduce(sums)
    slowest = torch.tensor(times[args.warmup :], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    r.times += slowest.tolist()
    r.losses += (sums[3:] / world).tolist()
    r.veth += float(sums[0]) / args.steps / args.rounds
    if CONTENDERS[r.name] is not None:
        r.log_cross = (r.log_cross or 0.0) + float(sums[1]) / args.steps / args.rounds
        r.log_link = (r.log_link or 0.0) + float(sums[2]) / args.steps / args.rounds


def probe() -> None:
    """Link bytes of one collective of S = 16 MiB on the world, each against the ring model's
    (S (N-1)/N per rank for an all-gather or reduce-scatter, twice that for an all-reduce; half
    the ranks' successors on the other host): gloo's own algorithms, seen from the wire."""
    import torch
    import torch.distributed as dist

    n, s = dist.get_world_size(), 4 * 2**20  # elements
    full, part = torch.ones(s), torch.ones(s // n)
    ops = {
        "all_reduce": (2, lambda: dist.all_reduce(full)),
        "all_gather": (1, lambda: dist.all_gather_into_tensor(full, part)),
        "reduce_scatter": (1, lambda: dist.reduce_scatter_tensor(part, full)),
    }
    for name, (k, call) in ops.items():
        call()  # connections and buffers set up outside the count
        dist.barrier()
        tx0 = tx_bytes()
        call()
        dist.barrier()
        sent = torch.tensor([tx_bytes() - tx0], dtype=torch.float64)
        dist.all_reduce(sent)
        ring = k * (n - 1) / n * 4 * s * n / 2  # every rank's bytes, half of them across
        if dist.get_rank() == 0:
            print(f"{name} of 16 MiB: {sent.item() / 2**20:.2f} MiB on the link, "
                  f"ring model {ring / 2**20:.2f} MiB", flush=True)  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from common import single_thread

    import shardwise.comm as comm

    # torch 2.13 deprecates the collectives FSDP2 and the probe call: one warning per call site.
    warnings.filterwarnings("ignore", r".*torch\.distributed\..* is deprecated", FutureWarning)
    single_thread()
    dist.init_process_group("gloo")
    if args.probe:
        probe()
        dist.destroy_process_group()
        return
    fns = {name: build(name, args) for name in args.names}
    # Keep every call of a block; after the builds, since initialize() sets the size from the
    # config's comms.flight_recorder (256 calls by default).
    comm.recorder().configure(size=1_000_000)
    results = [Result(name) for name in args.names]
    per_block = args.warmup + args.steps
    batches = make_batches(args.rounds * per_block, args.micro_batch * dist.get_world_size(),
                           args.seq)  # fmt: skip
    for k in range(args.rounds):
        for r in results:
            run_block(r, fns[r.name], batches, k * per_block, args)
        if dist.get_rank() == 0:
            done = ", ".join(f"{r.name} {1e3 * statistics.median(r.times):.0f}" for r in results)
            print(f"round {k + 1}/{args.rounds} (median ms so far): {done}", flush=True)
    if dist.get_rank() == 0:
        print(report(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the driver


def missing_tools() -> list[str]:
    """What the driver lacks: root, and iproute2's ip / tc and util-linux's unshare."""
    out = [] if os.geteuid() == 0 else ["root (network namespaces and tc need it)"]
    return out + [f"{t} (apt list --installed | grep iproute; util-linux for unshare)"
                  for t in ("ip", "tc", "unshare") if shutil.which(t) is None]  # fmt: skip


def throttle(ns: str, link: str, rate: str, delay: str) -> str:
    """This host's outgoing traffic on its veth end limited to ``rate``, ``delay`` late: netem
    when the kernel has it (sch_netem), else tbf (rate only, no delay); says which it got."""
    tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root"]
    netem = [*tc, "netem", "delay", delay, "rate", rate, "limit", "10000"]
    if subprocess.run(netem, capture_output=True).returncode == 0:
        return f"netem rate {rate}, delay {delay}"
    # A burst of 256 KiB (2 ms at 1 Gbit/s) holds a 64 KiB GSO segment of the veth and the
    # tokens of one timer tick; the queue may grow to 50 ms before tbf drops.
    tbf = [*tc, "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    subprocess.run(tbf, check=True, capture_output=True, text=True)
    return f"tbf rate {rate}, NO delay (this kernel has no netem qdisc: sch_netem missing)"


def host_argv(i: int, args: argparse.Namespace, argv: Sequence[str], master: str) -> list[str]:
    launcher = ["shardwise", "run"] if args.launcher == "shardwise" else ["torch.distributed.run"]
    return [sys.executable, "-m", *launcher, "--nnodes", "2", "--node-rank", str(i),
            "--nproc-per-node", "2", "--master-addr", master, "--master-port", str(args.port),
            str(Path(__file__).resolve()), *argv, "--worker"]  # fmt: skip


def drive(args: argparse.Namespace, argv: Sequence[str]) -> int:
    lacking = missing_tools()
    if lacking:
        print("hierarchical.py needs: " + "; ".join(lacking), file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE.parent / "tests"))
    from netns_hosts import (
        ADDRESSES,
        LINKS,
        NAMESPACES,
        Hosts,
        delete_namespaces,
        kill_in,
        veth_pair,
    )

    hosts = Hosts(Path(tempfile.mkdtemp(prefix="sw-hier-")))
    delete_namespaces()
    try:
        veth_pair(NAMESPACES, LINKS, ADDRESSES)
        shaped = [
            throttle(ns, link, args.rate, args.delay)
            for ns, link in zip(NAMESPACES, LINKS, strict=True)
        ]
        print(
            f"link {LINKS[0]} <-> {LINKS[1]}: {shaped[0]}; load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}",
            flush=True,
        )
        log1 = hosts.tmp / "host1.log"
        procs = []
        for i in range(2):
            env = hosts.environment(**{LINK_ENV: LINKS[i], "GLOO_SOCKET_IFNAME": LINKS[i]})
            cmd = hosts.command(i, host_argv(i, args, argv, ADDRESSES[0]))
            out = None if i == 0 else log1.open("w")  # host 0's rank 0 prints the table
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
        codes = [p.wait() for p in procs]
        if codes != [0, 0]:
            print(f"exit codes {codes}; host 1's log:\n{log1.read_text()[-4000:]}")
        print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        return 0 if codes == [0, 0] else 1
    finally:
        kill_in(NAMESPACES)
        delete_namespaces()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return drive(args, argv)


if __name__ == "__main__":
    sys.exit(main())
