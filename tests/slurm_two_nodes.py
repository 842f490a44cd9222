"""A real two-node Slurm: slurmctld and one slurmd per host, each host a network namespace.

``slurm_two_nodes`` (module fixture) makes namespaces with the addresses 10.78.0.1 and
10.78.0.2 on a veth pair, writes a ``slurm.conf`` naming ``slhost0`` and ``slhost1`` (each
with its own ``NodeAddr``, spool, pid and log files by ``%n``), starts ``slurmctld`` and
``slurmd -N slhost0`` in the first and ``slurmd -N slhost1`` in the second, and waits until
``sinfo`` shows both idle; it stops them and deletes the namespaces at the end, also on failure.

Each command enters its namespace with ``nsenter --net`` rather than ``ip netns exec``: the
latter remounts /sys, and slurmd then finds no cgroup hierarchy ("No filesystem mounted on
/sys/fs/cgroup"; mounting cgroup2 there instead is refused on this v1 host: "Hybrid mode is
not supported"). A UTS and a mount namespace give each host its name and a hosts file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netns_hosts import delete_namespaces, kill_in, veth_pair
from slurm_cluster import CONF, _install
from waits import scaled

_RUN = os.getpid() % 100000
NAMESPACES = (f"sw-s0-{_RUN}", f"sw-s1-{_RUN}")
LINKS = (f"sw-w0-{_RUN}", f"sw-w1-{_RUN}")
ADDRESSES = ("10.78.0.1", "10.78.0.2")
NAMES = ("slhost0", "slhost1")
HOSTS = "127.0.0.1 localhost\n10.78.0.1 slhost0\n10.78.0.2 slhost1\n"
DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "GLOO_SOCKET_IFNAME")  # fmt: skip


def _conf(home: Path) -> str:
    """The one-node fixture's settings, with two nodes at their own addresses."""
    head = CONF.split("NodeName=")[0].replace(
        "SlurmctldHost={host}(127.0.0.1)", "SlurmctldHost=slhost0(10.78.0.1)"
    )
    head = head.replace("/spool\n", "/spool-%n\n").replace("slurmd.pid", "slurmd-%n.pid")
    head = head.replace("slurmd.log", "slurmd-%n.log").format(dir=home)
    nodes = "".join(
        f"NodeName={n} NodeAddr={a} CPUs=8 State=UNKNOWN\n"
        for n, a in zip(NAMES, ADDRESSES, strict=True)
    )
    part = "PartitionName=debug Nodes=slhost0,slhost1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n"
    return head + nodes + part  # fmt: skip


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class TwoNodes:
    """The running cluster: ``run`` executes a command on host ``i`` (default the first)."""

    home: Path
    env: dict[str, str]

    def command(self, i: int, argv: list[str]) -> list[str]:
        script = (
            f'hostname {NAMES[i]} && mount --bind {self.home / "hosts"} /etc/hosts && exec "$@"'
        )
        return ["nsenter", f"--net=/run/netns/{NAMESPACES[i]}", "unshare", "--uts", "--mount",
                "--", "sh", "-c", script, "sh", *argv]  # fmt: skip

    def run(self, *argv: str, timeout: float = 300, host: int = 0) -> subprocess.CompletedProcess:
        cmd = self.command(host, list(argv))
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.home.glob("*.log"))
        )


def _stop(daemons: list[subprocess.Popen]) -> None:
    for d in daemons:
        try:
            os.killpg(d.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    time.sleep(1)
    kill_in(NAMESPACES)  # slurmstepd detaches: whatever is left in the hosts goes too
    delete_namespaces(NAMESPACES)


@pytest.fixture(scope="module")
def slurm_two_nodes(tmp_path_factory) -> Iterator[TwoNodes]:
    if os.geteuid() != 0:
        pytest.skip("two Slurm nodes need root (namespaces, slurmd)")
    _install()
    home = tmp_path_factory.mktemp("slurm2")
    (home / "state").mkdir()
    for name in NAMES:
        (home / f"spool-{name}").mkdir()
    (home / "hosts").write_text(HOSTS)
    (home / "slurm.conf").write_text(_conf(home))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in DROP}
    env.update(SLURM_CONF=str(home / "slurm.conf"), OMP_NUM_THREADS="1")
    cluster, daemons = TwoNodes(home, env), []
    try:
        veth_pair(NAMESPACES, LINKS, ADDRESSES)
        for host, argv in ((0, ["slurmctld", "-D", "-i"]), (0, ["slurmd", "-D", "-N", NAMES[0]]),
                           (1, ["slurmd", "-D", "-N", NAMES[1]])):  # fmt: skip
            daemons.append(subprocess.Popen(cluster.command(host, argv), env=env, start_new_session=True,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        deadline = time.monotonic() + scaled(90)
        while (
            cluster.run("sinfo", "-h", "-o", "%T %D", timeout=scaled(10)).stdout.strip() != "idle 2"
        ):
            assert time.monotonic() < deadline, (
                f"the two nodes never became idle:\n{cluster.logs()}"
            )
            time.sleep(0.5)
        yield cluster
    finally:
        _stop(daemons)
