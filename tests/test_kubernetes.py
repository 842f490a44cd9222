"""Kubernetes pods (launch/kubernetes.py): ``shardwise run`` reads the variables a Kubeflow
PyTorchJob, a Kubeflow TrainJob (JobSet) or an Indexed Job puts in each pod, and needs no flag
and no ssh. The variable names and values are the operators' own (training-operator
``pkg/controller.v1/pytorch/envvar.go``, ``master.go``, ``elastic.go``; trainer's torch plugin:
``PET_NODE_RANK`` from the Job completion index). Two "pods" on this machine (two launchers,
each given only a pod's environment) train like one process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from test_example_gpt import GPT_DIR, SMALL_RUN, _train, assert_trains_like
from waits import scaled

from shardwise.launch import kubernetes
from shardwise.launch.cli import make_parser
from shardwise.launch.env import detect_env
from shardwise.launch.run import build_torchrun_argv


def _pytorchjob_pod(rank: int, pods: int = 2, nproc: str = "1", port: int = 23456) -> dict:
    """What training-operator v1 sets in pod ``rank`` (0 is the master replica)."""
    addr = "127.0.0.1"
    world = pods * (int(nproc) if nproc.isdigit() else 1)  # "auto" counts 1 in WORLD_SIZE
    return dict(
        MASTER_ADDR=addr, MASTER_PORT=str(port), PET_MASTER_ADDR=addr, PET_MASTER_PORT=str(port),
        WORLD_SIZE=str(world), RANK=str(rank), PET_NPROC_PER_NODE=nproc,
        PET_NODE_RANK=str(rank), PET_NNODES=str(pods), PYTHONUNBUFFERED="0",
    )  # fmt: skip


TRAINJOB_POD = dict(  # Kubeflow Trainer (v2) on JobSet: PET_* only
    PET_NNODES="4", PET_NPROC_PER_NODE="8", PET_NODE_RANK="3", JOB_COMPLETION_INDEX="3",
    PET_MASTER_ADDR="job-node-0-0.job", PET_MASTER_PORT="29400",
)  # fmt: skip


def _argv(environ: dict, *flags: str) -> list[str]:
    args = make_parser().parse_args(["run", *flags, "train.py"])
    return build_torchrun_argv(kubernetes.resolve_kubernetes(args, environ))


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def test_a_pytorchjob_pod_gives_nodes_node_rank_and_master():
    got = _flags(_argv(_pytorchjob_pod(1, pods=3, nproc="4", port=23456)))
    want = {"nnodes": "3", "nproc-per-node": "4", "node-rank": "1", "master-addr": "127.0.0.1",
            "master-port": "23456"}  # fmt: skip
    assert {k: got.get(k) for k in want} == want, got


def test_a_trainjob_pod_on_jobset_is_read_from_pet_variables_alone():
    got = _flags(_argv(TRAINJOB_POD))
    assert (got["nnodes"], got["nproc-per-node"], got["node-rank"]) == ("4", "8", "3"), got
    assert (got["master-addr"], got["master-port"]) == ("job-node-0-0.job", "29400"), got


def test_a_jobset_of_your_own_gives_the_node_rank_by_its_completion_index():
    environ = dict(JOB_COMPLETION_INDEX="2", MASTER_ADDR="pytorch-workers-0-0.pytorch")
    args = make_parser().parse_args(["run", "--nnodes", "4", "train.py"])
    assert kubernetes.resolve_kubernetes(args, environ) is args, "no PET_: flags say it all"
    got = _flags(_argv({**environ, "PET_NNODES": "4"}))
    assert (got["node-rank"], got["master-addr"]) == ("2", "pytorch-workers-0-0.pytorch"), got


def test_an_operator_before_pet_variables_gives_nodes_from_world_size():
    """training-operator < 1.7 (and platforms following it) set RANK = pod index and
    WORLD_SIZE = pods, with MASTER_ADDR; nothing else."""
    environ = dict(MASTER_ADDR="job-master-0", MASTER_PORT="23456", WORLD_SIZE="2", RANK="1")
    got = _flags(_argv(environ, "--nproc-per-node", "2"))
    assert (got["nnodes"], got["node-rank"], got["master-addr"]) == ("2", "1", "job-master-0")


def test_command_line_flags_win_over_the_pod():
    got = _flags(_argv(TRAINJOB_POD, "--nproc-per-node", "2", "--master-port", "30000"))
    assert (got["nproc-per-node"], got["master-port"], got["node-rank"]) == ("2", "30000", "3")


def test_an_elastic_pytorchjob_uses_c10d_at_its_rendezvous_endpoint():
    environ = dict(PET_NNODES="1:3", PET_NPROC_PER_NODE="2", PET_RDZV_ENDPOINT="job-worker-0:23456",
                   PET_RDZV_BACKEND="c10d", PET_MAX_RESTARTS="3", PET_RDZV_ID="job")  # fmt: skip
    got = _flags(_argv(environ))
    assert got["nnodes"] == "1:3" and got["max-restarts"] == "3", got
    assert (got["rdzv-backend"], got["rdzv-endpoint"]) == ("c10d", "job-worker-0:23456"), got
    assert got["rdzv-id"] == "job" and "node-rank" not in got, got


def test_one_pod_keeps_the_standalone_rendezvous():
    argv = _argv(dict(PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_MASTER_ADDR="job-master-0"))
    assert "--standalone" in argv and "--nproc-per-node=2" in argv, argv


def test_a_pod_without_a_node_rank_is_refused():
    with pytest.raises(ValueError, match="no node rank for this pod: set PET_NODE_RANK"):
        _argv(dict(PET_NNODES="2", PET_MASTER_ADDR="job-master-0"))
    with pytest.raises(ValueError, match="PET_NODE_RANK=5 must be in 0..1"):
        _argv(dict(PET_NNODES="2", PET_NODE_RANK="5", PET_MASTER_ADDR="m"))


def test_a_worker_is_no_pod_and_the_taken_over_variables_are_dropped():
    worker = {**_pytorchjob_pod(1), "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
    assert kubernetes.pod_source(worker) is None
    environ = {**_pytorchjob_pod(1), "PET_MONITOR_INTERVAL": "1", "PET_RDZV_BACKEND": "c10d"}
    dropped = kubernetes.drop_taken_over(environ)
    assert "PET_RDZV_BACKEND" in dropped and "PET_NNODES" in dropped
    assert [k for k in environ if k.startswith("PET_")] == ["PET_MONITOR_INTERVAL"]


def test_python_train_py_in_a_pod_of_several_processes_is_refused():
    """The pod's RANK numbers pods: with 2 processes a pod, rank 1 of WORLD_SIZE 4 would
    wait for ranks that never come."""
    with pytest.raises(ValueError, match="RANK=1 is this pod's index .* `shardwise run"):
        detect_env(_pytorchjob_pod(1, nproc="2"))
    env = detect_env(_pytorchjob_pod(1, nproc="1"))  # one process a pod: RANK is its rank
    assert (env.rank, env.world_size, env.master_addr) == (1, 2, "127.0.0.1")


# ----------------------------------------------------------------------------- two pods


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt") / "one"
    _train(out, 1, ("--micro-batch", "4", "--grad-accum", "2"))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_pytorchjob_pods_train_like_one_process(one_process, tmp_path):
    """Two launchers, each with nothing but a PyTorchJob pod's variables (pods 0 and 1, one
    process each): DP2 of the example GPT equals the one-process run of the same batch."""
    out, port, procs = tmp_path / "run", _free_port(), []
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for pod in range(2):
        env = {**base, **_pytorchjob_pod(pod, port=port), "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "shardwise", "run", str(GPT_DIR / "train.py"), "--out",
                str(out), *SMALL_RUN, "--dp", "2", "--micro-batch", "4", "--grad-accum", "1"]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    logs = []
    try:
        logs = [p.communicate(timeout=scaled(300))[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"exit codes {codes}:\n" + "\n---\n".join(x[-3000:] for x in logs)
    assert "2 nodes x 1 process = world 2, master 127.0.0.1" in logs[1], logs[1][-2000:]
    assert "(node rank 1)" in logs[1] and "a Kubernetes pod (PET_NNODES" in logs[1]
    assert_trains_like(out, one_process, "two PyTorchJob pods")
