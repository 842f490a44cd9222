"""Where this process sits in the job, read from the launcher's environment.

Three launchers, checked in this order (the first that matches wins):

1. torchrun style: ``RANK`` and ``WORLD_SIZE`` (plus ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
   ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). ``shardwise run``, torchrun and
   DeepSpeed's launcher all set these. It wins over Slurm because ``srun torchrun ...`` sets
   both, and the workers must follow torchrun.
2. Slurm: ``SLURM_PROCID`` and ``SLURM_NTASKS`` (``srun python train.py``, one task per rank).
3. Nothing: one process, rank 0 of 1; no port, no launcher needed.

``init_distributed`` turns the result into an initialized default process group.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from shardwise.diagnose.interpose import cover_torch_distributed
from shardwise.diagnose.recorder import process_recorder
from shardwise.launch import kubernetes, slurm
from shardwise.launch.guard import guard_worker
from shardwise.launch.heartbeat import start_heartbeat
from shardwise.launch.interface import choose_gloo_interface

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torchrun's and DeepSpeed's default
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
TIMEOUT_VAR = "SHARDWISE_TIMEOUT_S"
BACKENDS = ("gloo", "nccl", "mpi")
# Set by mpirun/hydra: if they say "many processes" and no launcher above matched, each
# copy would silently train alone as rank 0 of 1.
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, and where rank 0 listens."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "none"


SINGLE_PROCESS = DistEnv(0, 1, 0, 1, 0, DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, "none")


def _get_int(environ: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set, as an int; ValueError naming it if it is not one."""
    for name in names:
        if name in environ:
            value = environ[name]
            try:
                return int(value.strip())
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def _check(env: DistEnv, names: Mapping[str, str]) -> DistEnv:
    """Reject an inconsistent environment; ``names`` maps each field to the variable it came from."""

    def fail(field: str, rule: str) -> None:
        raise ValueError(
            f"inconsistent {env.launcher} environment: {names.get(field, field)}="
            f"{getattr(env, field)} {rule}; check the launcher's variables (or unset them to run "
            "a single process)"
        )

    if env.world_size < 1:
        fail("world_size", "must be >= 1")
    if not 0 <= env.rank < env.world_size:
        fail("rank", f"must be in 0..{env.world_size - 1} ({names['world_size']}={env.world_size})")
    if not 1 <= env.local_world_size <= env.world_size:
        fail("local_world_size", f"must be in 1..{names['world_size']}={env.world_size}")
    if not 0 <= env.local_rank < env.local_world_size:
        fail("local_rank", f"must be in 0..{env.local_world_size - 1}")
    if env.node_rank < 0:
        fail("node_rank", "must be >= 0")
    if not 0 < env.master_port < 65536:
        fail("master_port", "must be a TCP port in 1..65535")
    return env


def _torchrun_env(environ: Mapping[str, str]) -> DistEnv:
    for have, need in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if have in environ and need not in environ:
            raise ValueError(
                f"{have} is set but {need} is not: set both, or neither for one process"
            )
    rank, world = _get_int(environ, "RANK"), _get_int(environ, "WORLD_SIZE")
    assert rank is not None and world is not None
    # DeepSpeed's launcher says LOCAL_SIZE / CROSS_RANK where torchrun says LOCAL_WORLD_SIZE / GROUP_RANK.
    local_world = _get_int(environ, "LOCAL_WORLD_SIZE", "LOCAL_SIZE") or world
    local_rank = _get_int(environ, "LOCAL_RANK")
    local_rank = rank % max(local_world, 1) if local_rank is None else local_rank
    node_rank = _get_int(environ, "GROUP_RANK", "CROSS_RANK")
    port = _get_int(environ, "MASTER_PORT")
    # RANK/WORLD_SIZE that merely mirror srun's task ids (exported by us or a batch script).
    slurm_ids = (_get_int(environ, "SLURM_PROCID"), _get_int(environ, "SLURM_NTASKS"))
    mirrors_srun = "TORCHELASTIC_RUN_ID" not in environ and slurm_ids == (rank, world)
    env = DistEnv(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=rank // max(local_world, 1) if node_rank is None else node_rank,
        master_addr=environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
        master_port=DEFAULT_MASTER_PORT if port is None else port,
        launcher="slurm" if mirrors_srun else "torchrun",
    )
    names = dict(
        rank="RANK",
        world_size="WORLD_SIZE",
        local_rank="LOCAL_RANK",
        local_world_size="LOCAL_WORLD_SIZE",
        node_rank="GROUP_RANK",
        master_port="MASTER_PORT",
    )
    return _check(env, names)


def _slurm_local_world(environ: Mapping[str, str], node_rank: int, world: int) -> int:
    """Tasks on this node: ``SLURM_NTASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE`` ("4(x2),2")."""
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if environ.get(name):
            try:
                counts = slurm.parse_tasks_per_node(environ[name])
            except ValueError as e:
                raise ValueError(f"environment variable {name}: {e}") from None
            return counts[node_rank] if node_rank < len(counts) else counts[0]
    return world


def _slurm_master(
    environ: Mapping[str, str], hostnames: Callable[[str], list[str]], one_node: bool
) -> str:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    for name in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        if environ.get(name):
            try:
                return hostnames(environ[name])[0]
            except ValueError as e:
                raise ValueError(f"environment variable {name}: {e}") from None
    if one_node:
        return DEFAULT_MASTER_ADDR
    raise ValueError(
        "Slurm job on several nodes without SLURM_NODELIST / SLURM_JOB_NODELIST: cannot tell "
        "which host runs rank 0; set MASTER_ADDR"
    )


def _slurm_env(environ: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> DistEnv:
    rank = _get_int(environ, "SLURM_PROCID")
    world = _get_int(environ, "SLURM_NTASKS", "SLURM_NPROCS")
    if world is None:
        raise ValueError("SLURM_PROCID is set but SLURM_NTASKS is not: launch the tasks with srun")
    assert rank is not None
    node_rank = _get_int(environ, "SLURM_NODEID") or 0
    local_world = _slurm_local_world(environ, node_rank, world)
    local_rank = _get_int(environ, "SLURM_LOCALID")
    port = _get_int(environ, "MASTER_PORT")
    if port is None:
        job_id = _get_int(environ, "SLURM_JOB_ID", "SLURM_JOBID")
        port = DEFAULT_MASTER_PORT if job_id is None else slurm.job_port(job_id)
    env = DistEnv(
        rank=rank,
        world_size=world,
        local_rank=rank % max(local_world, 1) if local_rank is None else local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=_slurm_master(environ, hostnames, one_node=local_world == world),
        master_port=port,
        launcher="slurm",
    )
    names = dict(
        rank="SLURM_PROCID",
        world_size="SLURM_NTASKS",
        local_rank="SLURM_LOCALID",
        local_world_size="SLURM_NTASKS_PER_NODE",
        node_rank="SLURM_NODEID",
        master_port="MASTER_PORT",
    )
    return _check(env, names)


def detect_env(
    environ: Mapping[str, str] | None = None,
    hostnames: Callable[[str], list[str]] | None = None,
) -> DistEnv:
    """Read this process's rank, world and master address from the launcher's variables.

    ``environ`` defaults to ``os.environ``; ``hostnames`` expands a Slurm node list (default:
    ``scontrol show hostnames`` when on PATH, else a pure-Python parser). Rules: torchrun's
    variables win over Slurm's, Slurm's over none (a single process). Non-integers and
    inconsistent values (``RANK >= WORLD_SIZE``...) raise ``ValueError`` naming the variable.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _torchrun_env(kubernetes.check_pod_env(environ))  # a pod's RANK numbers pods
    if "SLURM_PROCID" in environ:
        return _slurm_env(environ, hostnames or slurm.hostnames)
    for name in _MPI_SIZE_VARS:
        if (_get_int(environ, name) or 1) > 1:
            raise ValueError(
                f"{name}={environ[name]}: this looks like an mpirun launch, which shardwise does "
                "not read; launch with `shardwise run`, torchrun or srun instead"
            )
    return SINGLE_PROCESS


def resolve_timeout(
    timeout: datetime.timedelta | float | None, environ: Mapping[str, str] | None = None
) -> datetime.timedelta:
    """A collective timeout: ``timeout`` (seconds or timedelta), else ``$SHARDWISE_TIMEOUT_S``,
    else 30 minutes. A hung collective then fails with an error instead of hanging forever."""
    if timeout is None:
        environ = os.environ if environ is None else environ
        raw = environ.get(TIMEOUT_VAR)
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_VAR}={raw!r} is not a number of seconds") from None
        if timeout <= 0:
            raise ValueError(f"{TIMEOUT_VAR}={raw!r} must be > 0 seconds")
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout} must be positive")
    return timeout


def resolve_backend(dist_backend: str | None) -> str:
    """``nccl`` when CUDA is available, else ``gloo``; an explicit name must be usable here."""

    has_cuda = torch.cuda.is_available()
    if dist_backend is None:
        return "nccl" if has_cuda else "gloo"
    if dist_backend not in BACKENDS:
        raise ValueError(f"dist_backend={dist_backend!r} is not one of {', '.join(BACKENDS)}")
    if dist_backend == "nccl" and not has_cuda:
        raise ValueError(
            "dist_backend='nccl' needs CUDA, which is not available: use 'gloo' on CPU"
        )
    if dist_backend == "mpi" and not dist.is_mpi_available():
        raise ValueError(
            "dist_backend='mpi': this torch was built without MPI; use 'gloo' or 'nccl'"
        )
    return dist_backend


def _env_of_initialized_group() -> DistEnv:
    """The env of an already-initialized world; the group's rank and size are the truth."""

    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        env = detect_env()
    except ValueError:
        env = SINGLE_PROCESS
    if (env.rank, env.world_size) == (rank, world):
        return env
    # Initialized by hand (a FileStore, shardwise.spawn): assume one node.
    return replace(
        env, rank=rank, world_size=world, local_rank=rank, local_world_size=world, node_rank=0
    )


def _override(env: DistEnv, rank: int, world_size: int) -> DistEnv:
    """Apply ``init_distributed(rank=, world_size=)``; without a launcher, all on one node."""
    rank = env.rank if rank < 0 else rank
    world = env.world_size if world_size <= 0 else world_size
    if env.launcher == "none":
        env = replace(env, local_rank=rank, local_world_size=world)
    env = replace(env, rank=rank, world_size=world)
    return _check(env, dict(rank="rank", world_size="world_size"))


def _export(env: DistEnv) -> None:
    """Publish the env the way ``init_method='env://'`` and user code expect to read it."""
    os.environ.update(
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        LOCAL_WORLD_SIZE=str(env.local_world_size),
    )


def _init_group(
    env: DistEnv,
    backend: str,
    timeout: datetime.timedelta,
    init_method: str | None,
    verbose: bool,
) -> DistEnv:
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)  # before init: NCCL binds each rank to its device
    choose_gloo_interface(backend, env.world_size, env.local_world_size, env.master_addr)
    if backend == "mpi":  # MPI knows its own ranks
        dist.init_process_group("mpi", timeout=timeout)
        return replace(env, rank=dist.get_rank(), world_size=dist.get_world_size())
    if init_method is None and env.world_size == 1:
        store = dist.HashStore()  # in memory: a lone process needs no rendezvous and no port
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return env
    _export(env)
    dist.init_process_group(
        backend,
        init_method=init_method or "env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    atexit.register(teardown_world)
    guard_worker(env.rank)  # die with the launcher; uncaught errors reach its failure summary
    master = (env.master_addr, env.master_port)  # a lost host is named within a minute
    start_heartbeat(env.node_rank, env.local_rank, env.world_size, env.local_world_size, master)
    process_recorder().arm()  # the hang watchdog, before any collective (diagnose/watchdog.py)
    cover_torch_distributed()  # the script's own dist.* calls and groups too (diagnose/interpose.py)
    if verbose and env.rank == 0:
        print(
            f"[shardwise] {backend} world of {env.world_size} processes ready "
            f"(launcher {env.launcher}, master {env.master_addr}:{env.master_port})",
            file=sys.stderr,
            flush=True,
        )
    return env


def teardown_world() -> None:
    """Free unreachable engines (and the process groups they hold) while the world is still
    up, then tear the world down: left to the interpreter's final teardown, the gloo groups
    are destroyed in no particular order and a script that returned normally sometimes dies
    of SIGABRT ("terminate called without an active exception"; 2 runs in 16 of a 2-rank DP
    step, 0 in 16 with the collection; benchmarks/clean_exit.py counts it). Run at exit for
    the world ``init_distributed`` set up, and by ``shardwise.spawn``'s children."""
    process_recorder().disarm()  # its thread polls the store of the world that goes now
    gc.collect()

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_MASTER_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object = None,
    rank: int = -1,
    world_size: int = -1,
) -> DistEnv:
    """Initialize the default process group from the launcher's environment (DeepSpeed's signature).

    Rules: idempotent (an initialized world is returned as is); ``dist_init_required=False``
    only reads the env. Backend: nccl with CUDA else gloo, or ``dist_backend``. One process
    with no launcher uses an in-memory ``HashStore``: no address, no port. Otherwise
    MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK are exported and ``env://`` is used
    (``init_method`` overrides it). ``distributed_port`` is the port when the env names none.
    ``rank``/``world_size`` >= 0 override the env. ``timeout`` defaults to
    ``$SHARDWISE_TIMEOUT_S`` or 30 min. ``auto_mpi_discovery`` and ``config`` are accepted
    for DeepSpeed compatibility and unused: an mpirun launch raises (see ``detect_env``).
    """

    del auto_mpi_discovery, config
    if dist.is_available() and dist.is_initialized():
        return _env_of_initialized_group()
    env = detect_env()
    if env.launcher != "slurm" and "MASTER_PORT" not in os.environ:
        env = replace(env, master_port=distributed_port)
    if rank >= 0 or world_size > 0:
        env = _override(env, rank, world_size)
    if dist_init_required is False:
        return env
    return _init_group(
        env, resolve_backend(dist_backend), resolve_timeout(timeout), init_method, verbose
    )
