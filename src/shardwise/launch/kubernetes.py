"""Kubernetes: ``shardwise run`` takes nodes, node rank and master from the pod's variables.

A pod of a multi-node job runs one ``shardwise run`` (it starts the pod's processes itself);
there is no ssh between pods. What the operators put in every pod:

=====================================  ====================================================
Kubeflow training-operator PyTorchJob  ``MASTER_ADDR``, ``MASTER_PORT`` (the master pod's
                                       service), ``WORLD_SIZE`` (pods x ``nprocPerNode``),
                                       ``RANK`` (the *pod's* index: master 0, worker i ->
                                       i + 1), ``PET_NNODES`` (pods, or ``MIN:MAX`` with an
                                       ``elasticPolicy``), ``PET_NPROC_PER_NODE``,
                                       ``PET_NODE_RANK`` (= ``RANK``), ``PET_MASTER_ADDR``,
                                       ``PET_MASTER_PORT``; with an ``elasticPolicy`` also
                                       ``PET_RDZV_ENDPOINT``, ``PET_RDZV_BACKEND``,
                                       ``PET_RDZV_ID``, ``PET_RDZV_CONF``, ``PET_MAX_RESTARTS``
Kubeflow Trainer TrainJob (on JobSet)  ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
                                       ``PET_NODE_RANK`` (the Job completion index),
                                       ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``
JobSet / Indexed Job of your own       ``JOB_COMPLETION_INDEX`` (Kubernetes, in every pod of an
                                       Indexed Job); the rest is what the manifest sets
=====================================  ====================================================

``PET_<FLAG>`` is torchrun's own spelling of its flags (torch.distributed.argparse_util).
Rules (``resolve_kubernetes``), each only where the command line did not say:
``--nnodes`` <- ``PET_NNODES``; ``--nproc-per-node`` <- ``PET_NPROC_PER_NODE``; with several
nodes, ``--node-rank`` <- ``PET_NODE_RANK``, else ``JOB_COMPLETION_INDEX``, and the master
<- ``PET_MASTER_ADDR``/``PORT``, else ``PET_RDZV_ENDPOINT``, else ``MASTER_ADDR``/``PORT``;
``--max-restarts``, ``--rdzv-id``, ``--rdzv-conf`` <- ``PET_MAX_RESTARTS``, ``PET_RDZV_ID``,
``PET_RDZV_CONF``. A pod with only ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` (operators
before 1.7, and platforms that follow them) gives nodes ``WORLD_SIZE`` and node rank ``RANK``.
The ``PET_`` variables taken over are then removed from what torchrun's agent parses
(``drop_taken_over``): one not passed on (``PET_RDZV_BACKEND=c10d``) would otherwise change
the rendezvous behind the command ``shardwise run`` prints.

Workers started without ``shardwise run`` (``python train.py`` in such a pod) see the pod's
``RANK``, which numbers pods: ``check_pod_env`` refuses it when a pod holds several processes.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping, MutableMapping

# Torchrun flags whose PET_ variable shardwise reads and then passes on (or decides) itself.
TAKEN_OVER = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_MAX_RESTARTS",
    "PET_RDZV_ID",
    "PET_RDZV_CONF",
    "PET_RDZV_ENDPOINT",
    "PET_RDZV_BACKEND",
    "PET_STANDALONE",
)
# Set by torchrun's agent and shardwise.spawn in each worker, never by an operator in a pod.
_WORKER_VARS = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def _int(environ: Mapping[str, str], name: str) -> int | None:
    if not environ.get(name, "").strip():
        return None
    try:
        return int(environ[name].strip())
    except ValueError:
        raise ValueError(
            f"environment variable {name}={environ[name]!r} is not an integer"
        ) from None


def _nodes(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """``PET_NNODES``: ``N`` or torchrun's elastic ``MIN:MAX`` -> (fewest, most)."""
    text = environ.get("PET_NNODES", "").strip()
    if not text:
        return None
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"PET_NNODES={text!r}: expected N or MIN:MAX") from None
    if not 1 <= low <= high:
        raise ValueError(f"PET_NNODES={text!r}: need 1 <= MIN <= MAX")
    return low, high


def _endpoint(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    """The master: PET_MASTER_*, else PET_RDZV_ENDPOINT (``host:port``), else MASTER_*."""
    if environ.get("PET_MASTER_ADDR"):
        return environ["PET_MASTER_ADDR"], _int(environ, "PET_MASTER_PORT")
    if environ.get("PET_RDZV_ENDPOINT"):
        host, _, port = environ["PET_RDZV_ENDPOINT"].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"PET_RDZV_ENDPOINT={environ['PET_RDZV_ENDPOINT']!r}: expected host:port"
            )
        return host, int(port)
    return environ.get("MASTER_ADDR") or None, _int(environ, "MASTER_PORT")


def _legacy_pod(environ: Mapping[str, str]) -> bool:
    """``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` of a pod (no PET_, not inside a worker)."""
    if any(v in environ for v in _WORKER_VARS) or any(k.startswith("PET_") for k in environ):
        return False
    return all(environ.get(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def pod_source(environ: Mapping[str, str]) -> str | None:
    """Which variables describe this pod's job, or None outside such a pod."""
    if any(v in environ for v in _WORKER_VARS):
        return None  # a worker: its launcher already read the pod
    found = [v for v in ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR") if v in environ]
    if found:
        return ", ".join(found)
    if _legacy_pod(environ) and (_int(environ, "WORLD_SIZE") or 1) > 1:
        return "RANK, WORLD_SIZE, MASTER_ADDR (no PET_ variables: nodes = WORLD_SIZE)"
    return None


def _node_rank(environ: Mapping[str, str]) -> tuple[int | None, str]:
    for name in ("PET_NODE_RANK", "JOB_COMPLETION_INDEX"):
        value = _int(environ, name)
        if value is not None:
            return value, name
    if _legacy_pod(environ):
        return _int(environ, "RANK"), "RANK"
    return None, ""


def resolve_kubernetes(args: argparse.Namespace, environ: Mapping[str, str]) -> argparse.Namespace:
    """Fill what the command line left unset from the pod's variables (module docstring);
    ``args`` itself is left as it was. Outside a pod (``pod_source`` is None): ``args``."""
    source = pod_source(environ)
    if source is None or getattr(args, "slurm", False) or getattr(args, "hostfile", None):
        return args
    out = copy.copy(args)
    nodes = _nodes(environ)
    if nodes is None and _legacy_pod(environ):
        nodes = (_int(environ, "WORLD_SIZE") or 1,) * 2
    if args.nnodes is None and nodes is not None:
        out.min_nnodes, out.nnodes = nodes
    if args.nproc_per_node is None and environ.get("PET_NPROC_PER_NODE"):
        out.nproc_per_node = environ["PET_NPROC_PER_NODE"].strip()
    if args.max_restarts == 0 and _int(environ, "PET_MAX_RESTARTS"):
        out.max_restarts = _int(environ, "PET_MAX_RESTARTS")
    out.rdzv_id = args.rdzv_id or environ.get("PET_RDZV_ID") or None
    out.rdzv_conf = args.rdzv_conf or environ.get("PET_RDZV_CONF") or None
    if (out.nnodes or 1) > 1:  # one node keeps torchrun's standalone rendezvous
        _fill_multinode(args, out, environ)
    out.pod_source = source
    return out


def _fill_multinode(
    args: argparse.Namespace, out: argparse.Namespace, environ: Mapping[str, str]
) -> None:
    addr, port = _endpoint(environ)
    out.master_addr = args.master_addr or addr
    out.master_port = args.master_port or port
    elastic = (getattr(out, "min_nnodes", None) or out.nnodes) != out.nnodes
    if args.node_rank is None and not elastic and out.max_restarts == 0:
        rank, name = _node_rank(environ)
        if rank is None:
            raise ValueError(
                f"{out.nnodes} nodes but no node rank for this pod: set PET_NODE_RANK (the "
                "PyTorchJob operator does; in a JobSet, JOB_COMPLETION_INDEX is read too) or "
                "pass --node-rank"
            )
        if not 0 <= rank < out.nnodes:
            raise ValueError(f"{name}={rank} must be in 0..{out.nnodes - 1} ({out.nnodes} nodes)")
        out.node_rank = rank


def drop_taken_over(environ: MutableMapping[str, str]) -> list[str]:
    """Remove the PET_ variables shardwise read (module docstring) before torchrun parses
    its flags; the others (``PET_MONITOR_INTERVAL``, ``PET_LOG_DIR``...) stay its own."""
    dropped = [name for name in TAKEN_OVER if name in environ]
    for name in dropped:
        del environ[name]
    return dropped


def check_pod_env(environ: Mapping[str, str]) -> Mapping[str, str]:
    """``environ``, unless its ``RANK`` numbers a pod that holds several processes: then
    ``python train.py`` would take a pod's index for a process rank; say to use
    ``shardwise run``, which starts the pod's processes and numbers them."""
    if any(v in environ for v in _WORKER_VARS) or "PET_NODE_RANK" not in environ:
        return environ
    nproc = environ.get("PET_NPROC_PER_NODE", "1").strip()
    if nproc == "1" or environ.get("RANK") != environ["PET_NODE_RANK"]:
        return environ
    raise ValueError(
        f"RANK={environ.get('RANK')} is this pod's index (PET_NODE_RANK), not a process rank, "
        f"and the pod is to hold PET_NPROC_PER_NODE={nproc} processes: start them with "
        "`shardwise run train.py` (it reads the pod's variables), not `python train.py`"
    )
