"""Gloo worlds on one host name the loopback interface, so that no process group waits on DNS.

Each gloo group resolves the host name twice unless ``GLOO_SOCKET_IFNAME`` is set; on a machine
whose host name is not in /etc/hosts every group then waits for the resolver (a CI run took
140 s for a DP2 x TP2 test that takes 0.6 s here). The rule, as a table: pin only when the
environment says every rank is here, never over the user's own choice, never for NCCL.
"""

import os
import socket
import subprocess
import sys

import pytest
from waits import scaled

from shardwise.launch.interface import IFNAME_VAR, loopback_interface, pin_gloo_to_loopback

LO = loopback_interface()

# (backend, world, local world, master address, environment) -> pinned?
CASES = {
    "one process": ("gloo", 1, 1, "node7", {}, True),
    "master on loopback": ("gloo", 4, 4, "127.0.0.1", {}, True),
    "master is localhost": ("gloo", 2, 2, "localhost", {}, True),
    "torchrun says all local": ("gloo", 4, 4, "node7", {"LOCAL_WORLD_SIZE": "4"}, True),
    "slurm says one node": ("gloo", 2, 2, "node7", {"SLURM_NTASKS_PER_NODE": "2"}, True),
    "two hosts": ("gloo", 4, 2, "node7", {"LOCAL_WORLD_SIZE": "2"}, False),
    "local size only a default": ("gloo", 4, 4, "10.0.0.1", {}, False),
    "nccl": ("nccl", 1, 1, "127.0.0.1", {}, False),
    "user's interface wins": ("gloo", 1, 1, "127.0.0.1", {IFNAME_VAR: "eth1"}, False),
}


@pytest.mark.skipif(LO is None, reason="this machine has no loopback interface named lo/lo0")
@pytest.mark.parametrize("case", sorted(CASES))
def test_gloo_is_pinned_to_loopback_only_when_every_rank_is_here(case):
    backend, world, local, master, environ, pinned = CASES[case]
    environ = dict(environ)
    before = environ.get(IFNAME_VAR)
    got = pin_gloo_to_loopback(backend, world, local, master, environ)
    assert (got is not None) == pinned, f"{case}: pinned={got!r}"
    want = LO if pinned else before
    assert environ.get(IFNAME_VAR) == want, f"{case}: {IFNAME_VAR}={environ.get(IFNAME_VAR)!r}"


SCRIPT = (
    "import os; from shardwise.launch.env import init_distributed; "
    "init_distributed(verbose=False); print(os.environ.get('GLOO_SOCKET_IFNAME'))"
)


@pytest.mark.skipif(LO is None, reason="this machine has no loopback interface named lo/lo0")
def test_init_distributed_pins_before_the_first_group():
    env = {k: v for k, v in os.environ.items() if k not in (IFNAME_VAR, "RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=scaled(120)
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == LO, f"one process, no launcher: {out.stdout!r}"


@pytest.mark.parametrize("one_node", [True, False], ids=["one node", "several nodes"])
def test_the_launcher_asks_dns_for_its_name_at_most_once(monkeypatch, one_node):
    """torchrun's agent stamps each event with a reverse lookup of the host name (seven per
    two-worker launch); ``shardwise run`` makes that one lookup, or none on one node."""
    from torch.distributed.elastic.agent.server import api as agent_api

    from shardwise.launch.hostname import resolve_hostname_once

    lookups = []
    monkeypatch.setattr(agent_api, "_get_fq_hostname", lambda: lookups.append(1) or "n1.example")
    assert resolve_hostname_once(one_node=one_node), "this torch's agent has the helper"
    names = {agent_api._get_fq_hostname() for _ in range(7)}
    want = {socket.gethostname()} if one_node else {"n1.example"}
    assert names == want, f"one_node={one_node}: {names}"
    assert len(lookups) == (0 if one_node else 1), f"one_node={one_node}: {len(lookups)} lookups"


@pytest.mark.skipif(LO is None, reason="this machine has no loopback interface named lo/lo0")
def test_an_inherited_loopback_interface_on_two_hosts_is_named(capsys):
    """A shell or job that ran one-host work keeps GLOO_SOCKET_IFNAME=lo; on two hosts gloo
    then listens where the other host is refused. The user's setting is kept, but named."""
    from shardwise.launch.interface import choose_gloo_interface

    environ = {IFNAME_VAR: LO, "LOCAL_WORLD_SIZE": "2"}
    assert choose_gloo_interface("gloo", 4, 2, "10.77.0.1", environ) is None
    assert environ[IFNAME_VAR] == LO, "the user's choice must be kept"
    err = capsys.readouterr().err
    assert f"{IFNAME_VAR}={LO}" in err and "spans hosts" in err, err
    choose_gloo_interface("gloo", 4, 4, "127.0.0.1", {IFNAME_VAR: LO, "LOCAL_WORLD_SIZE": "4"})
    assert "spans hosts" not in capsys.readouterr().err, "one host: no warning"
