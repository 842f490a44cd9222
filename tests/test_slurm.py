"""Slurm's compressed notations, expanded the way ``scontrol show hostnames`` does."""

import os
import stat

import pytest

from shardwise.launch import slurm
from shardwise.launch.cli import make_parser
from shardwise.launch.run import resolve_slurm
from shardwise.launch.slurm import hostnames, job_port, parse_nodelist, parse_tasks_per_node

NODELISTS = [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[8-10]", ["node8", "node9", "node10"]),  # no padding: width of the low bound
    ("node[008-010]", ["node008", "node009", "node010"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("gpu[1-2]-ib,login", ["gpu1-ib", "gpu2-ib", "login"]),
    ("n[3]", ["n3"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    (" node[1-2] ", ["node1", "node2"]),
]


@pytest.mark.parametrize("nodelist, expected", NODELISTS)
def test_parse_nodelist_expands_every_form(nodelist, expected):
    assert parse_nodelist(nodelist) == expected, f"nodelist {nodelist!r}"


BAD_NODELISTS = [
    ("node[3-1]", "'3-1' goes backwards"),
    ("node[01-03", "never closed"),
    ("node]", "']' without '['"),
    ("n[[1]]", "nested '['"),
    ("n[]", "empty brackets"),
    ("n[a-b]", "'a-b' is not a number"),
    ("n[1-2],,m", "empty host name"),
    ("", "empty Slurm nodelist"),
]


@pytest.mark.parametrize("nodelist, named", BAD_NODELISTS)
def test_parse_nodelist_errors_name_the_bad_part(nodelist, named):
    with pytest.raises(ValueError) as info:
        parse_nodelist(nodelist)
    assert named in str(info.value), f"nodelist {nodelist!r}: {info.value}"


@pytest.mark.parametrize(
    "spec, expected",
    [("4", [4]), ("4(x2)", [4, 4]), ("4(x2),2", [4, 4, 2]), ("1,2(x3)", [1, 2, 2, 2])],
)
def test_parse_tasks_per_node(spec, expected):
    assert parse_tasks_per_node(spec) == expected, f"spec {spec!r}"


@pytest.mark.parametrize("spec", ["", "4(2)", "x", "4(x2),", "-1"])
def test_parse_tasks_per_node_rejects(spec):
    with pytest.raises(ValueError, match="tasks-per-node"):
        parse_tasks_per_node(spec)


def _fake_scontrol(tmp_path, monkeypatch, body):
    script = tmp_path / "scontrol"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_hostnames_asks_scontrol_when_it_is_on_path(tmp_path, monkeypatch):
    # Slurm is the authority on its own notation: its answer wins over our parser's.
    _fake_scontrol(tmp_path, monkeypatch, 'echo "[$1 $2 $3]" >&2; printf "alpha\\nbeta\\n"')
    assert hostnames("node[1-2]") == ["alpha", "beta"]


def test_hostnames_falls_back_to_the_parser(tmp_path, monkeypatch):
    _fake_scontrol(tmp_path, monkeypatch, "exit 1")
    assert hostnames("node[1-2]") == ["node1", "node2"], "scontrol failing"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert hostnames("node[1-2]") == ["node1", "node2"], "no scontrol on PATH"


def test_job_port_is_deterministic_and_in_range():
    assert job_port(12345) == 32345
    assert job_port(12345 + slurm.DEFAULT_PORT_SPAN) == job_port(12345)
    ports = {job_port(j) for j in range(0, 100_000, 7)}
    assert min(ports) >= 20000 and max(ports) < 40000


def _run_args(*flags):
    return make_parser().parse_args(["run", *flags])


def test_run_slurm_flag_fills_nodes_from_srun():
    """``srun --ntasks-per-node=1 shardwise run --slurm``: one agent per node."""
    environ = dict(
        SLURM_JOB_NODELIST="gpu[03-04]", SLURM_NODEID="1", SLURM_NNODES="2", SLURM_NTASKS="2", SLURM_JOB_ID="777"
    )  # fmt: skip
    args = resolve_slurm(
        _run_args("--slurm", "t.py"), environ, hostnames=lambda s: ["gpu03", "gpu04"]
    )
    got = {
        k: getattr(args, k)
        for k in ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_id")
    }
    assert got == dict(
        nnodes=2, node_rank=1, master_addr="gpu03", master_port=20777, rdzv_id="slurm-777"
    )
    one_node = resolve_slurm(_run_args("--slurm", "t.py"), {**environ, "SLURM_NNODES": "1", "SLURM_NTASKS": "1"}, hostnames=lambda s: ["gpu03"])  # fmt: skip
    assert (one_node.nnodes, one_node.master_addr) == (1, None), "one node keeps --standalone"
    with pytest.raises(ValueError, match="--ntasks-per-node=1"):
        resolve_slurm(_run_args("--slurm", "t.py"), {**environ, "SLURM_NTASKS": "8"}, hostnames=lambda s: ["a", "b"])  # fmt: skip
    with pytest.raises(ValueError, match="run it under srun"):
        resolve_slurm(_run_args("--slurm", "t.py"), {})
