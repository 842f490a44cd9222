"""Reading the launcher's environment, and initializing torch.distributed from it.

``detect_env`` is a pure function of a mapping, tested here as a table. ``init_distributed``
is tested in child processes (the test process keeps no default process group): one process
with no launcher at all, and a two-task Slurm job faked through its variables.
"""

import datetime
import os
import random
import socket
import subprocess
import sys

import pytest
import torch
from waits import scaled

import shardwise
from shardwise.launch import env as env_mod
from shardwise.launch.env import DistEnv, detect_env, resolve_backend, resolve_timeout

TORCHRUN = dict(
    RANK="5",
    WORLD_SIZE="8",
    LOCAL_RANK="1",
    LOCAL_WORLD_SIZE="4",
    GROUP_RANK="1",
    MASTER_ADDR="10.0.0.1",
    MASTER_PORT="29600",
    TORCHELASTIC_RUN_ID="abc",
)
SLURM = dict(
    SLURM_PROCID="5",
    SLURM_NTASKS="8",
    SLURM_LOCALID="1",
    SLURM_NODEID="1",
    SLURM_TASKS_PER_NODE="4(x2)",
    SLURM_JOB_NODELIST="node[01-02]",
    SLURM_JOB_ID="12345",
)


def _env(rank, world, local, local_world, node, addr, port, launcher):
    return DistEnv(rank, world, local, local_world, node, addr, port, launcher)


CASES = [
    ("nothing: one process", {}, _env(0, 1, 0, 1, 0, "127.0.0.1", 29500, "none")),
    ("torchrun", TORCHRUN, _env(5, 8, 1, 4, 1, "10.0.0.1", 29600, "torchrun")),
    (
        "torchrun, only RANK/WORLD_SIZE: one node assumed",
        dict(RANK="1", WORLD_SIZE="2"),
        _env(1, 2, 1, 2, 0, "127.0.0.1", 29500, "torchrun"),
    ),
    (
        "DeepSpeed launcher spellings LOCAL_SIZE / CROSS_RANK",
        dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_SIZE="2", CROSS_RANK="1"),
        _env(3, 4, 1, 2, 1, "127.0.0.1", 29500, "torchrun"),
    ),
    (
        "torchrun wins over Slurm (srun torchrun)",
        {**SLURM, **TORCHRUN},
        _env(5, 8, 1, 4, 1, "10.0.0.1", 29600, "torchrun"),
    ),
    (
        "RANK/WORLD_SIZE mirroring srun's ids count as Slurm",
        {
            **SLURM,
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
        },
        _env(5, 8, 1, 4, 1, "127.0.0.1", 29500, "slurm"),
    ),
    ("slurm", SLURM, _env(5, 8, 1, 4, 1, "node01", 32345, "slurm")),
    (
        "slurm SLURM_NTASKS_PER_NODE, MASTER_ADDR/PORT override",
        {**SLURM, "SLURM_NTASKS_PER_NODE": "4", "MASTER_ADDR": "ib0", "MASTER_PORT": "1234"},
        _env(5, 8, 1, 4, 1, "ib0", 1234, "slurm"),
    ),
    (
        "slurm uneven nodes 4,2: node 1 has 2 tasks",
        {**SLURM, "SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_TASKS_PER_NODE": "4,2"},
        _env(5, 6, 1, 2, 1, "node01", 32345, "slurm"),
    ),
    (
        "slurm without job id or nodelist on one node",
        dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2"),
        _env(0, 2, 0, 2, 0, "127.0.0.1", 29500, "slurm"),
    ),
    (
        "slurm bracket groups and suffix in the nodelist",
        {**SLURM, "SLURM_JOB_NODELIST": "rack[2-3]-gpu[07-08]-ib"},
        _env(5, 8, 1, 4, 1, "rack2-gpu07-ib", 32345, "slurm"),
    ),
    (
        "an mpirun of one process is one process",
        dict(OMPI_COMM_WORLD_SIZE="1"),
        _env(0, 1, 0, 1, 0, "127.0.0.1", 29500, "none"),
    ),
]


@pytest.mark.parametrize("case, environ, expected", CASES, ids=[c[0] for c in CASES])
def test_detect_env(case, environ, expected):
    # No scontrol in tests: the pure-Python parser expands the node list.
    assert detect_env(environ, hostnames=env_mod.slurm.parse_nodelist) == expected, case


def test_detect_env_asks_hostnames_for_the_master():
    seen = []

    def fake(nodelist):
        seen.append(nodelist)
        return ["first", "second"]

    assert detect_env(SLURM, hostnames=fake).master_addr == "first"
    assert seen == ["node[01-02]"]


ERRORS = [
    ("RANK >= WORLD_SIZE", dict(RANK="2", WORLD_SIZE="2"), "RANK=2"),
    ("RANK not an integer", dict(RANK="zero", WORLD_SIZE="2"), "RANK='zero' is not an integer"),
    ("WORLD_SIZE zero", dict(RANK="0", WORLD_SIZE="0"), "WORLD_SIZE=0"),
    ("RANK without WORLD_SIZE", dict(RANK="0"), "RANK is set but WORLD_SIZE is not"),
    ("WORLD_SIZE without RANK", dict(WORLD_SIZE="2"), "WORLD_SIZE is set but RANK is not"),
    (
        "LOCAL_RANK too big",
        dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="2", LOCAL_WORLD_SIZE="2"),
        "LOCAL_RANK=2",
    ),
    (
        "LOCAL_WORLD_SIZE > WORLD_SIZE",
        dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="4"),
        "LOCAL_WORLD_SIZE=4",
    ),
    (
        "MASTER_PORT out of range",
        dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="70000"),
        "MASTER_PORT=70000",
    ),
    (
        "MASTER_PORT not a number",
        dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="http"),
        "MASTER_PORT='http'",
    ),
    ("SLURM_PROCID >= SLURM_NTASKS", {**SLURM, "SLURM_PROCID": "8"}, "SLURM_PROCID=8"),
    ("SLURM_NTASKS missing", dict(SLURM_PROCID="0"), "SLURM_NTASKS is not"),
    ("bad SLURM_TASKS_PER_NODE", {**SLURM, "SLURM_TASKS_PER_NODE": "4(2)"}, "SLURM_TASKS_PER_NODE"),
    ("bad nodelist", {**SLURM, "SLURM_JOB_NODELIST": "node[2-1]"}, "SLURM_JOB_NODELIST"),
    (
        "several nodes, no nodelist",
        {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"},
        "set MASTER_ADDR",
    ),
    ("mpirun is not read", dict(OMPI_COMM_WORLD_SIZE="4"), "OMPI_COMM_WORLD_SIZE=4"),
]


@pytest.mark.parametrize("case, environ, named", ERRORS, ids=[c[0] for c in ERRORS])
def test_detect_env_errors_name_the_variable(case, environ, named):
    with pytest.raises(ValueError) as info:
        detect_env(environ, hostnames=env_mod.slurm.parse_nodelist)
    assert named in str(info.value), f"{case}: {info.value}"


@pytest.mark.parametrize(
    "timeout, environ, seconds",
    [
        (None, {}, 1800),
        (None, {"SHARDWISE_TIMEOUT_S": "90"}, 90),
        (5, {"SHARDWISE_TIMEOUT_S": "90"}, 5),
        (2.5, {}, 2.5),
        (datetime.timedelta(minutes=2), {}, 120),
    ],
)
def test_resolve_timeout(timeout, environ, seconds):
    assert resolve_timeout(timeout, environ).total_seconds() == seconds, (timeout, environ)


@pytest.mark.parametrize(
    "timeout, environ, named",
    [
        (None, {"SHARDWISE_TIMEOUT_S": "soon"}, "SHARDWISE_TIMEOUT_S"),
        (None, {"SHARDWISE_TIMEOUT_S": "0"}, "SHARDWISE_TIMEOUT_S"),
        (0, {}, "timeout"),
    ],
)
def test_resolve_timeout_rejects(timeout, environ, named):
    with pytest.raises(ValueError, match=named):
        resolve_timeout(timeout, environ)


def test_resolve_backend():
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert resolve_backend(None) == expected, "default backend follows CUDA"
    assert resolve_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="gloo, nccl, mpi"):
        resolve_backend("hccl")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use 'gloo'"):
            resolve_backend("nccl")


def test_init_distributed_is_the_public_one_with_deepspeeds_defaults():
    import inspect

    assert shardwise.init_distributed is env_mod.init_distributed
    params = inspect.signature(shardwise.init_distributed).parameters
    assert list(params) == [
        "dist_backend", "auto_mpi_discovery", "distributed_port", "verbose", "timeout",
        "init_method", "dist_init_required", "config", "rank", "world_size",
    ]  # fmt: skip
    assert params["distributed_port"].default == 29500


def test_dist_init_required_false_only_reads_the_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    got = shardwise.init_distributed(dist_init_required=False, rank=1, world_size=2)
    assert (got.rank, got.world_size, got.local_rank, got.launcher) == (1, 2, 1, "none")
    assert not torch.distributed.is_initialized(), "nothing may be initialized"


def _clean_env(**extra):
    launcher_vars = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_",
        "OMPI_",
        "PMI_",
        "TORCHELASTIC",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher_vars)}
    env.update(OMP_NUM_THREADS="1", PATH=os.environ["PATH"], **extra)
    return env


SINGLE = """
import torch.distributed as dist, shardwise
env = shardwise.init_distributed()
again = shardwise.init_distributed()
t = dist.get_world_size(), dist.get_rank(), dist.get_backend()
print("OK", env.launcher, env == again, t)
"""


def test_init_distributed_single_process_needs_no_launcher():
    out = subprocess.run(
        [sys.executable, "-c", SINGLE],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert out.returncode == 0, out.stderr
    assert "OK none True (1, 0, 'gloo')" in out.stdout, out.stdout


SLURM_RANK = """
import torch, torch.distributed as dist, shardwise
env = shardwise.init_distributed(timeout=60)
t = torch.tensor([env.rank + 1.0]); dist.all_reduce(t)
print("RANK", env.rank, env.launcher, env.master_addr, env.master_port, int(t.item()))
"""


def _job_id_of_a_free_port() -> int:
    """A job id whose port (20000 + id) is free now and below the kernel's ephemeral range.

    Ports from 32768 up are handed to every outgoing connection and every ``bind(0)`` (the
    gloo pairs and stores of other runs on the machine): a job port there could be taken, or
    listened on by a stranger rank 1 would then talk to. 30000-32767 is only used by ports
    asked for by number.
    """
    for job_id in random.sample(range(10_000, 12_768), 50):
        with socket.socket() as s:
            try:
                s.bind(("", 20_000 + job_id))
            except OSError:
                continue
            return job_id
    raise AssertionError("no free port in 30000-32767 for the fake Slurm job")


def test_init_distributed_from_a_slurm_job_of_two_tasks():
    # Two processes with srun's variables; the port comes from the job id, chosen free (a port
    # taken between the check and rank 0's bind only costs a retry).
    for _attempt in range(3):
        job_id = _job_id_of_a_free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", SLURM_RANK],
                env=_clean_env(
                    SLURM_PROCID=str(r),
                    SLURM_NTASKS="2",
                    SLURM_LOCALID=str(r),
                    SLURM_NODEID="0",
                    SLURM_TASKS_PER_NODE="2",
                    SLURM_JOB_NODELIST="localhost",
                    SLURM_JOB_ID=str(job_id),
                ),  # fmt: skip
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=scaled(120)) for p in procs]
        if (
            all(p.returncode == 0 for p in procs)
            or "address already in use" not in outs[0][1].lower()
        ):
            break
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"slurm task {r}: {err}"
        assert f"RANK {r} slurm localhost {20000 + job_id} 3" in out, f"slurm task {r}: {out}"
    assert "[shardwise] gloo world of 2 processes ready (launcher slurm" in outs[0][1], (
        "rank 0 says it is ready"
    )
