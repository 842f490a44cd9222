"""The ``shardwise`` command: ``run`` launches a script, ``topo`` prints a layout,
``inspect`` and ``export`` read a checkpoint, ``diagnose`` explains a hang, ``plan`` ranks
layouts (docs/planner.md), ``verify`` compares layouts with one process (docs/verify.md).

    shardwise run --nproc-per-node 2 --timeout 300 train.py --lr 1e-3
    shardwise topo --dp 2 --pp 2 --tp 2 --nnodes 2 --nproc-per-node 4
    shardwise topo --subgroup even --world-size 8
    shardwise inspect checkpoints/
    shardwise export checkpoints/ model.safetensors
    shardwise diagnose runs/exp1

Flags take torchrun's spellings and DeepSpeed's (``--num_gpus``, ``--num_nodes``,
``--master_port``...), so either habit works. ``topo`` starts no process.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shardwise.checkpoint import cli as checkpoint_cli
from shardwise.diagnose import cli as diagnose_cli
from shardwise.launch.run import launch
from shardwise.parallel.moe.groups import expert_rank_groups
from shardwise.parallel.zero.hpz import hpz_groups
from shardwise.plan import cli as plan_cli
from shardwise.topology import AXIS_NAMES, Topology, TopologyError
from shardwise.verify import cli as verify_cli


class NodesRange(argparse.Action):
    """``--nnodes N`` or torchrun's elastic ``MIN:MAX``: ``nnodes`` is the most nodes (what
    every check and the mesh use), ``min_nnodes`` the fewest the job goes on with."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        lo, _, hi = str(values).partition(":")
        try:
            low, high = int(lo), int(hi or lo)
        except ValueError:
            parser.error(f"{option_string}={values}: give N or MIN:MAX (e.g. 2, or 1:2)")
        if not 1 <= low <= high:
            parser.error(f"{option_string}={values}: need 1 <= MIN <= MAX")
        namespace.nnodes, namespace.min_nnodes = high, low


# (flags, argparse options): torchrun's spelling first, then the aliases DeepSpeed users type.
RUN_FLAGS = [
    (("--nproc-per-node", "--nproc_per_node", "--num_gpus", "--num_accelerators"),
     dict(dest="nproc_per_node", help="processes on this node: N, auto, cpu or gpu (default: one per CUDA device, else 1)")),
    (("--nnodes", "--num_nodes"), dict(action=NodesRange, help="nodes: N, or MIN:MAX for an elastic job (default 1)")),
    (("--node-rank", "--node_rank"), dict(type=int, help="this node's rank (default 0)")),
    (("--master-addr", "--master_addr"), dict(help="host of node 0 (required with several nodes)")),
    (("--master-port", "--master_port"),
     dict(type=int, help="port on node 0 (default: a free one on one node, 29500 on several)")),
    (("--local-addr",), dict(help="address this node advertises (default 127.0.0.1 on one node)")),
    (("--max-restarts", "--max_restarts"),
     dict(type=int, default=0, help="restart all workers up to N times after a failure")),
    (("--rdzv-id", "--rdzv_id"), dict(help="job id shared by all nodes when restarts use c10d")),
    (("--rdzv-conf", "--rdzv_conf"),
     dict(help="c10d rendezvous options KEY=VALUE,..., e.g. last_call_timeout=5 (torchrun's; its default last call waits 30 s)")),
    (("-m", "--module"), dict(action="store_true", help="run the script as `python -m`")),
    (("--omp-num-threads",), dict(type=int, help="OMP_NUM_THREADS of each worker (default: inherited, else 1)")),
    (("--local-rank-arg",), dict(action="store_true", help="also pass --local_rank=N, as DeepSpeed's launcher")),
    (("-H", "--hostfile"), dict(help="DeepSpeed hostfile: 'host slots=N' lines")),
    (("-i", "--include"), dict(default="", help="NODE[:SLOT,...][@NODE...] to keep")),
    (("-e", "--exclude"), dict(default="", help="NODE[:SLOT,...][@NODE...] to drop")),
    (("--slurm",), dict(action="store_true", help="nodes, node rank and master from srun (one task per node)")),
    (("--dry-run",), dict(action="store_true", help="print the torchrun command instead of running it")),
    (("--timeout",), dict(type=float, help="collective timeout in seconds of every group (SHARDWISE_TIMEOUT_S; default 1800)")),
    (("--run-dir",), dict(help="where a hang's records and report go: RUN_DIR/diagnose (SHARDWISE_RUN_DIR)")),
    (("--bind_cores_to_rank", "--bind-cores-to-rank"),
     dict(action="store_true", help="pin each local rank to its share of the cores, OMP_NUM_THREADS = that share")),
    (("--bind_core_list", "--bind-core-list"), dict(help="cores to share out, e.g. 0,2-5 (default: all this process may use)")),
    (("--no_local_rank", "--no-local-rank"),
     dict(action="store_true", help="accepted for DeepSpeed's command lines: --local_rank is passed only with --local-rank-arg")),
]  # fmt: skip


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="launch a script on N processes per node (through torchrun)", allow_abbrev=False
    )
    for flags, options in RUN_FLAGS:
        p.add_argument(*flags, **options)
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _add_topo_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("topo", help="print the rank table of a layout (starts nothing)")
    p.add_argument(
        "--dp", type=int, default=None, help="data-parallel size (default: what is left)"
    )
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (context_parallel)")
    p.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size (MoE ep_size, divides dp)"
    )
    p.add_argument(
        "--mics-shard-size",
        "--mics_shard_size",
        dest="mics_shard_size",
        type=int,
        default=-1,
        help="zero_optimization.mics_shard_size: ZeRO shards within groups of this many data "
        "ranks and replicates across them (MiCS / HSDP); <= 0: off",
    )
    p.add_argument(
        "--zero-hpz-partition-size",
        "--zero_hpz_partition_size",
        dest="zero_hpz_partition_size",
        type=int,
        default=1,
        help="zero_optimization.zero_hpz_partition_size: ZeRO-3 keeps a secondary copy of its "
        "parameter shards within groups of this many data ranks (hpZ); <= 1: off",
    )
    p.add_argument("--nnodes", "--num_nodes", dest="nnodes", type=int, default=None)
    p.add_argument(
        "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, default=None
    )
    p.add_argument("--world-size", dest="world_size", type=int, default=None)
    p.add_argument(
        "--subgroup",
        default=None,
        help="'even', 'odd' or ranks like 0,2,4,6: print that group instead",
    )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    _add_topo_parser(sub)
    checkpoint_cli.add_parsers(sub)
    diagnose_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    verify_cli.add_parser(sub)
    return parser


def topo_world_size(args: argparse.Namespace) -> int:
    """``--world-size``, else ``--nnodes`` x ``--nproc-per-node``, else dp x cp x pp x tp.

    ``--nproc-per-node`` alone only places the ranks on nodes.
    """
    per_node = args.nproc_per_node
    if args.nnodes is None:
        return args.world_size or (args.dp or 1) * args.cp * args.pp * args.tp
    if not per_node:
        raise ValueError("--nnodes needs --nproc-per-node to place ranks on nodes")
    launched = args.nnodes * per_node
    if args.world_size and args.world_size != launched:
        raise ValueError(
            f"--world-size={args.world_size} but --nnodes={args.nnodes} x "
            f"--nproc-per-node={per_node} = {launched}: give one or the other"
        )
    return launched


def _format_groups(topo: Topology, ep: int = 1) -> list[str]:
    lines = []
    for axis in ("dp", "cp", "pp", "tp"):
        if axis == "cp" and topo.cp == 1:
            continue
        groups = topo.axis_groups(axis)
        listed = " ".join(str(g) for g in groups)
        lines.append(
            f"{AXIS_NAMES[axis]} groups ({axis}={topo.size(axis)}, {len(groups)} groups): {listed}"
        )
    if ep > 1:  # the expert axis splits the data axis (docs/moe.md)
        ep_groups, edp_groups = expert_rank_groups(topo, ep)
        for kind, groups in (("expert-parallel", ep_groups), ("expert-data", edp_groups)):
            listed = " ".join(str(g) for g in groups)
            lines.append(f"{kind} groups (ep={ep}, {len(groups)} groups): {listed}")
    return lines


def parse_subgroup(spec: str, world_size: int) -> list[int]:
    """``even`` / ``odd`` / ``0,2,4,6`` -> sorted member ranks, all inside the world."""
    if spec in ("even", "odd"):
        return list(range(0 if spec == "even" else 1, world_size, 2))
    try:
        ranks = sorted({int(r) for r in spec.split(",")})
    except ValueError:
        raise ValueError(f"--subgroup={spec!r}: use 'even', 'odd' or ranks like 0,2,4,6") from None
    outside = [r for r in ranks if not 0 <= r < world_size]
    if outside:
        raise ValueError(f"--subgroup ranks {outside} are outside the world of size {world_size}")
    return ranks


def subgroup_table(members: Sequence[int], world_size: int, nproc_per_node: int = 0) -> str:
    """Every rank of the world, whether it is in the group, and its rank inside it."""
    per_node = nproc_per_node or world_size
    rows = [("rank", "host", "local_rank", "member", "group_rank")]
    for r in range(world_size):
        inside = r in members
        group_rank = str(members.index(r)) if inside else "-"
        rows.append(
            (
                str(r),
                f"node{r // per_node}",
                str(r % per_node),
                "yes" if inside else "no",
                group_rank,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    header = f"Subgroup of {len(members)} of {world_size} processes: {list(members)}"
    return "\n".join([header, *lines])


def topo_command(args: argparse.Namespace) -> str:
    """The text ``shardwise topo`` prints."""
    world = topo_world_size(args)
    per_node = args.nproc_per_node or 0
    if args.subgroup is not None:
        return subgroup_table(parse_subgroup(args.subgroup, world), world, per_node)
    shard = max(args.mics_shard_size, 0)
    topo = Topology.build(world, dp=args.dp, pp=args.pp, tp=args.tp, cp=args.cp, zero_shard=shard)
    groups = _format_groups(topo, args.ep)
    if topo.cp > 1:  # gradients average, and ZeRO shards, over data x context
        listed = " ".join(str(g) for g in topo.dp_cp_groups())
        groups.append(f"data-context groups (dp x cp={topo.dp_cp}): {listed}")
    for kind, size in (("shard", shard), ("replicate", topo.replicas)) if shard else ():
        listed = " ".join(str(g) for g in topo.zero_groups(kind))
        groups.append(f"ZeRO {kind} groups (MiCS, {size} ranks each): {listed}")
    if (size := args.zero_hpz_partition_size) > 1:
        listed = " ".join(str(g) for g in hpz_groups(topo, size))
        groups.append(f"ZeRO-3 secondary groups (hpZ, {size} ranks each): {listed}")
    return "\n".join([topo.rank_table(nproc_per_node=per_node), "", *groups])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardwise`` console script and ``python -m shardwise``."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "topo":
            print(topo_command(args))
            return 0
        if args.command in ("inspect", "export", "checkpoint"):
            print(checkpoint_cli.run(args))
            return 0
        if args.command == "diagnose":
            print(diagnose_cli.run(args))
            return 0
        if args.command == "plan":
            return plan_cli.run(args)
        if args.command == "verify":
            return verify_cli.run(args)

        return launch(args)
    except (ValueError, TopologyError) as e:
        print(f"shardwise {args.command}: error: {e}", file=sys.stderr)
        return 2
