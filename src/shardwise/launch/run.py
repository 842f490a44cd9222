"""``shardwise run``: turn our flags into torchrun's and hand over to its elastic agent.

We build the argv of ``torch.distributed.run`` and call its ``main`` in this process: the
agent then starts, watches and restarts the workers. Nothing here opens a socket.

Decisions (see docs/launch.md):
- One node and no ``--master-addr/--master-port``: torchrun's ``--standalone`` (its store
  binds a free port itself, so concurrent jobs on one machine never collide) and
  ``--local-addr 127.0.0.1`` (nothing is advertised beyond loopback).
- Several nodes, or an explicit address/port: static rendezvous at ``--master-addr`` and
  ``--master-port`` (default 29500, as torchrun and DeepSpeed), honouring ``--node-rank``.
- ``--max-restarts N > 0`` with an address: c10d rendezvous, and one store per round
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): torch's shared store hangs restarted workers.
- ``OMP_NUM_THREADS=1`` per worker unless set (``--omp-num-threads`` changes it).
- No ``--local_rank=N`` argument unless ``--local-rank-arg`` (workers read ``LOCAL_RANK``).
- Preemption (launch/preempt.py): workers that saved and exited with ``PREEMPTED_EXIT_CODE``
  make this command exit with it too, with one line instead of torchrun's traceback; a signal
  that stopped the workers before they saved exits 128 + the signal's number, as a shell does.
- ``--timeout S`` and ``--run-dir D`` reach the workers as ``SHARDWISE_TIMEOUT_S`` (every
  group's collective timeout) and ``SHARDWISE_RUN_DIR`` (where a hang's records go).
- DeepSpeed's ``.deepspeed_env`` (``~/`` then ``./``; launch/deepspeed_env.py) is exported to
  the workers; a flag of this command wins over the file, the file over the inherited
  environment.
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from shardwise.diagnose import report
from shardwise.diagnose.dump import RUN_DIR_VAR, diagnose_dir
from shardwise.launch import deepspeed_env, hostfile, kubernetes, slurm
from shardwise.launch.bound import BINDING_VAR, parse_core_list, split_cores
from shardwise.launch.env import DEFAULT_MASTER_PORT, TIMEOUT_VAR, _get_int
from shardwise.launch.guard import LAUNCHER_VAR
from shardwise.launch.hostname import resolve_hostname_once
from shardwise.launch.preempt import PREEMPTED_EXIT_CODE, REPORT_DIR_VAR, read_reports
from shardwise.launch.summary import first_failure, opening_line

LOOPBACK = "127.0.0.1"
NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's symbolic --nproc-per-node values
LOCAL_RANK_MACRO = "${local_rank}"
SHARE_STORE_VAR = (
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torchrun's agent substitutes each worker's local rank
)


def _torchrun_flags() -> set[str]:
    """Option strings this torch's torchrun accepts (``--local-addr`` is not in every version)."""

    return {s for action in torchrun.get_args_parser()._actions for s in action.option_strings}


def default_nproc() -> int:
    """Processes per node when not given: one per CUDA device, else 1 (DeepSpeed: all devices)."""

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _check_nproc(value: object) -> str:
    text = str(value)
    if text in NPROC_WORDS or (text.isdigit() and int(text) >= 1):
        return text
    raise ValueError(f"--nproc-per-node={text!r} must be an integer >= 1 or one of {NPROC_WORDS}")


def _rendezvous_argv(args: argparse.Namespace, nnodes: int, elastic: bool = False) -> list[str]:
    """How the agents meet: standalone, static (fixed node ranks) or c10d (survives restarts,
    and lets an elastic job go on with fewer nodes and take them back)."""
    conf = getattr(args, "rdzv_conf", None)
    if nnodes == 1 and args.master_addr is None and args.master_port is None:
        return ["--standalone", *([f"--rdzv-conf={_rdzv_conf(conf)}"] if conf else [])]
    if nnodes > 1 and not args.master_addr:
        raise ValueError(
            f"--master-addr is required with --nnodes={nnodes}: give the host of node 0 "
            "(or use --slurm, or a hostfile with -H)"
        )
    addr, port = args.master_addr or LOOPBACK, args.master_port or DEFAULT_MASTER_PORT
    if args.max_restarts > 0 or elastic:
        # The static rendezvous keeps one store across attempts and restarted workers hang on
        # the previous attempt's keys (pytorch/pytorch#135712, still so in torch 2.13): c10d
        # with an unshared store per round (see launch_env) restarts cleanly.
        return [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={addr}:{port}",
            f"--rdzv-id={args.rdzv_id or f'shardwise-{port}'}",
            *([f"--rdzv-conf={_rdzv_conf(conf)}"] if conf else []),
        ]
    if getattr(args, "rdzv_conf", None):
        raise ValueError(
            f"--rdzv-conf={args.rdzv_conf} configures the c10d rendezvous, used on several "
            "nodes only with --max-restarts N > 0 or --nnodes MIN:MAX: add one, or drop it"
        )
    node_rank = args.node_rank or 0
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank={node_rank} must be in 0..{nnodes - 1} (--nnodes={nnodes})")
    return [f"--node-rank={node_rank}", f"--master-addr={addr}", f"--master-port={port}"]


def _rdzv_conf(text: str) -> str:
    """``KEY=VALUE,...`` as torchrun takes it, each pair checked for its ``=``."""
    pairs = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in pairs if p.count("=") != 1 or not p.split("=")[0] or not p.split("=")[1]]
    if bad or not pairs:
        raise ValueError(
            f"--rdzv-conf={text!r}: give KEY=VALUE pairs joined by commas, e.g. "
            "last_call_timeout=5,join_timeout=600"
        )
    return ",".join(pairs)


def build_torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The argv of ``torch.distributed.run`` for a parsed ``shardwise run`` command line.

    Pure: reads ``args`` only (see the module docstring for the rules it applies).
    """
    nnodes = args.nnodes or 1
    if nnodes < 1:
        raise ValueError(f"--nnodes={nnodes} must be >= 1")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts={args.max_restarts} must be >= 0")
    nproc = args.nproc_per_node if args.nproc_per_node is not None else default_nproc()
    low = getattr(args, "min_nnodes", None) or nnodes
    elastic = low != nnodes
    argv = [f"--nnodes={low}:{nnodes}" if elastic else f"--nnodes={nnodes}"]
    argv.append(f"--nproc-per-node={_check_nproc(nproc)}")
    argv += _rendezvous_argv(args, nnodes, elastic)
    local_addr = args.local_addr or (LOOPBACK if nnodes == 1 else None)
    if local_addr and "--local-addr" in _torchrun_flags():
        argv.append(f"--local-addr={local_addr}")
    argv.append(f"--max-restarts={args.max_restarts}")
    if _binds(args):  # pinned by shardwise.launch.bound first
        argv += ["--module", "shardwise.launch.bound", *(["--as-module"] if args.module else [])]
    elif args.module:
        argv.append("--module")
    argv.append(args.script)
    if args.local_rank_arg:  # DeepSpeed's launcher style: before the user's own arguments
        argv.append(f"--local_rank={LOCAL_RANK_MACRO}")
    return argv + list(args.script_args)


def launch_env(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables to add to the environment the workers inherit."""
    updates = {}
    if args.omp_num_threads is not None:
        updates["OMP_NUM_THREADS"] = str(args.omp_num_threads)
    elif "OMP_NUM_THREADS" not in environ:
        updates["OMP_NUM_THREADS"] = "1"  # N processes x all cores each would oversubscribe the CPU
    if args.max_restarts > 0 and SHARE_STORE_VAR not in environ:
        # A fresh store per rendezvous round, so restarted workers never read stale keys.
        updates[SHARE_STORE_VAR] = "1"
    if getattr(args, "timeout", None) is not None:
        if not args.timeout > 0:
            raise ValueError(f"--timeout={args.timeout:g} must be > 0 seconds")
        updates[TIMEOUT_VAR] = f"{args.timeout:g}"
    if getattr(args, "run_dir", None):
        updates[RUN_DIR_VAR] = os.path.abspath(args.run_dir)
    if getattr(args, "visible_devices", None):
        updates["CUDA_VISIBLE_DEVICES"] = args.visible_devices
    if _binds(args):
        updates.update(_core_binding(args))
    return updates


def _binds(args: argparse.Namespace) -> bool:
    """--bind_cores_to_rank, or a --bind_core_list (which means it)."""
    return bool(getattr(args, "bind_cores_to_rank", False) or getattr(args, "bind_core_list", None))


def _core_binding(args: argparse.Namespace) -> dict[str, str]:
    """Each local rank's share of the cores (``--bind_core_list``, else the cores this process
    may use), and OMP_NUM_THREADS = one share, unless --omp-num-threads says otherwise."""

    listed = getattr(args, "bind_core_list", None)
    cores = parse_core_list(listed) if listed else sorted(os.sched_getaffinity(0))
    nproc = args.nproc_per_node if args.nproc_per_node is not None else default_nproc()
    if not str(nproc).isdigit():
        raise ValueError(f"--bind_cores_to_rank needs a number of processes, not {nproc!r}")
    shares = split_cores(cores, int(nproc))
    binding = ";".join(",".join(map(str, share)) for share in shares)
    threads = str(args.omp_num_threads or len(shares[0]))
    return {BINDING_VAR: binding, "OMP_NUM_THREADS": threads}


def _this_node(names: list[str], hostname: str | None) -> int:
    """Index of this machine in ``names``, matched by host name, FQDN or short name."""
    hostname = hostname or socket.gethostname()
    own = {hostname, socket.getfqdn()} if hostname == socket.gethostname() else {hostname}
    own |= {h.split(".")[0] for h in own} | {"localhost", LOOPBACK}
    for i, name in enumerate(names):
        if name in own or name.split(".")[0] in own:
            return i
    raise ValueError(
        f"this machine ({hostname}) is not among the hosts {names}: run on one of them "
        "or pass --node-rank"
    )


def resolve_hosts(args: argparse.Namespace, hostname: str | None = None) -> argparse.Namespace:
    """Apply DeepSpeed's ``-H/--hostfile`` and ``-i/--include`` / ``-e/--exclude``.

    Each node runs the same command and finds its own line: nnodes = hosts kept, node rank =
    this host's position, processes = its slots, master = the first host. Without a hostfile
    the filters apply to ``localhost`` with one slot per CUDA device (1 on CPU).
    """
    if not (args.hostfile or args.include or args.exclude):
        return args
    if (args.include or args.exclude) and (
        args.nnodes is not None or args.nproc_per_node is not None
    ):
        raise ValueError(
            "--num_nodes/--nnodes and --num_gpus/--nproc-per-node cannot be combined with "
            "--include/--exclude: the filter already chooses the nodes and slots"
        )
    if args.hostfile:
        try:
            slots = hostfile.parse_hostfile(Path(args.hostfile).read_text())
        except OSError as e:
            raise ValueError(f"--hostfile {args.hostfile}: {e.strerror}") from None
    else:
        slots = {"localhost": default_nproc()}
    if args.nnodes is not None:  # DeepSpeed: the first N hosts ...
        slots = dict(list(slots.items())[: args.nnodes])
    if args.nproc_per_node is not None:  # ... and the first N slots of each
        slots = {h: min(n, int(_check_nproc(args.nproc_per_node))) for h, n in slots.items()}
    hosts = {h: list(range(n)) for h, n in slots.items()}
    kept = hostfile.parse_resource_filter(hosts, args.include or "", args.exclude or "")
    if not kept:
        raise ValueError("no host left after --include/--exclude")
    names = list(kept)
    node_rank = args.node_rank if args.node_rank is not None else _this_node(names, hostname)
    mine = kept[names[node_rank]]
    out = copy.copy(args)
    out.nnodes, out.node_rank, out.nproc_per_node = len(names), node_rank, str(len(mine))
    if len(names) > 1 and not args.master_addr:
        out.master_addr = names[0]
    if mine != list(range(len(mine))):  # a subset of the devices: hide the others
        out.visible_devices = ",".join(map(str, mine))
    return out


def resolve_slurm(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    hostnames: Callable[[str], list[str]] = slurm.hostnames,
) -> argparse.Namespace:
    """``--slurm``: nodes, node rank and master from ``srun --ntasks-per-node=1 shardwise run``."""
    if not args.slurm:
        return args
    nodelist = next(
        (
            environ[v]
            for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if environ.get(v)
        ),
        None,
    )
    node_id = _get_int(environ, "SLURM_NODEID")
    if nodelist is None or node_id is None:
        raise ValueError("--slurm needs SLURM_JOB_NODELIST and SLURM_NODEID: run it under srun")
    hosts = hostnames(nodelist)
    nnodes = _get_int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES") or len(hosts)
    ntasks = _get_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if ntasks is not None and ntasks != nnodes:
        raise ValueError(
            f"--slurm: SLURM_NTASKS={ntasks} on {nnodes} nodes; start one `shardwise run` per "
            "node (srun --ntasks-per-node=1), it starts --nproc-per-node workers itself"
        )
    out = copy.copy(args)
    out.nnodes = args.nnodes or nnodes
    out.node_rank = node_id if args.node_rank is None else args.node_rank
    if out.nnodes > 1:  # one node keeps --standalone
        job_id = _get_int(environ, "SLURM_JOB_ID", "SLURM_JOBID")
        out.master_addr = args.master_addr or hosts[0]
        port = _get_int(environ, "MASTER_PORT") or (
            slurm.job_port(job_id) if job_id is not None else None
        )
        out.master_port = args.master_port or port
        out.rdzv_id = args.rdzv_id or (f"slurm-{job_id}" if job_id is not None else None)
    return out


def launch(args: argparse.Namespace) -> int:
    """Run the workers under torchrun's elastic agent, in this process; the exit code."""

    args = kubernetes.resolve_kubernetes(args, os.environ)  # a PyTorchJob's or JobSet's pod
    args = resolve_slurm(resolve_hosts(args), os.environ)
    kubernetes.drop_taken_over(os.environ)  # torchrun's agent runs what the argv says, no PET_*
    argv = build_torchrun_argv(args)
    exported, files = deepspeed_env.exports(os.environ)
    updates = {**exported, **launch_env(args, {**os.environ, **exported})}
    if args.dry_run:
        print(shlex.join([*(f"{k}={v}" for k, v in updates.items()), "torchrun", *argv]))
        return 0
    if not args.module and not Path(args.script).is_file():
        raise ValueError(f"script {args.script!r} not found (give a path, or -m for a module)")
    if getattr(args, "pod_source", None):
        print(f"shardwise run: a Kubernetes pod ({args.pod_source})", file=sys.stderr)
    if files:
        names = ", ".join(sorted(exported)) or "nothing"
        print(f"shardwise run: exporting {names} ({', '.join(map(str, files))})", file=sys.stderr)
    print(opening_line(args, argv), file=sys.stderr, flush=True)
    os.environ.update(updates)
    os.environ[LAUNCHER_VAR] = str(os.getpid())  # workers die with this process (launch/guard.py)
    resolve_hostname_once(one_node=(args.nnodes or 1) == 1)  # not one DNS lookup per agent event
    reports = os.environ[REPORT_DIR_VAR] = tempfile.mkdtemp(prefix="shardwise-run-")
    started = time.time()
    try:
        torchrun.main(argv)
    except ChildFailedError as e:  # the agent already gave up after --max-restarts
        codes = {f.exitcode for f in e.failures.values()}
        # A SIGTERM reached workers, not this process; the agent then SIGTERMs the others,
        # which may be past their handler (the interpreter shutting down), hence -SIGTERM.
        if PREEMPTED_EXIT_CODE in codes and codes <= {PREEMPTED_EXIT_CODE, -signal.SIGTERM}:
            return _preempted(reports, "SIGTERM to the workers")
        print(f"{first_failure(e)}\nshardwise run: workers failed\n{e}", file=sys.stderr)
        _settle_hang(e, started)
        return 1
    except SignalException as e:  # torchrun forwarded it and waited for the workers
        if read_reports(reports):
            return _preempted(reports, e.sigval.name)
        print(
            f"shardwise run: stopped by {e.sigval.name}; the workers exited without saving "
            "(no checkpoint.save_dir in their config, or they outlived the grace period, "
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default)",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    finally:
        shutil.rmtree(reports, ignore_errors=True)
    return 0


def _settle_hang(error: ChildFailedError, started: float) -> None:
    """A hang's conclusion, when the ranks wrote records but the failure does not carry it: the
    reporting rank was stopped before it finished (diagnose/watchdog.py), so report it here."""
    found = report.settle(diagnose_dir(), started)
    if found and "shardwise diagnosis:" not in str(error):
        print(found, file=sys.stderr)


def _preempted(reports: str, why: str) -> int:
    """The one line a preempted job prints; its exit code."""
    saved = {r.get("checkpoint") for r in read_reports(reports)} - {None}
    where = f"saved {', '.join(sorted(saved))}" if saved else "saved their step"
    print(
        f"shardwise run: preempted ({why}): the workers {where} and exited; exit code "
        f"{PREEMPTED_EXIT_CODE}, run the same command again to resume",
        file=sys.stderr,
    )
    return PREEMPTED_EXIT_CODE
